"""The dataset that goes with ``--format speculators-hs``: what speculators >= 0.5 trains from.

Its trainer's ``ArrowDataset(datapath)`` reads ``datasets.load_from_disk(datapath)`` (columns
``input_ids``, ``loss_mask``, ``seq_len``, in torch format) and, for row ``i``,
``datapath/hidden_states/hs_{i}.safetensors``, whose ``token_ids`` must equal the row's
``input_ids``. So ``extract --format speculators-hs --output DIR`` writes the states under
``DIR/hidden_states/`` (with the run's records: run.json, checksums.jsonl, manifest.json) and, when
the dataset is complete, this dataset in ``DIR``: the input's rows as extracted (a prompt cut to
``max_model_len - 1`` is cut here too, with its loss mask), so every row matches its file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from ...errors import DatasetError

#: the files ``datasets.Dataset.save_to_disk`` writes (and ``load_from_disk`` reads)
DATASET_FILES = ("state.json", "dataset_info.json")


def require_datasets() -> None:
    """Fail before any engine starts when the ``datasets`` package is missing."""
    try:
        import datasets  # noqa: F401
    except ImportError as e:
        raise DatasetError(
            "--format speculators-hs writes its input_ids/loss_mask dataset with the `datasets` "
            "package (pip install datasets; speculators >= 0.5 needs it too)"
        ) from e


def write_dataset(dest: Path, input_path: str, n_samples: int, max_model_len: int, checksum: str) -> dict:
    """Write rows ``0..n_samples-1`` of ``input_path`` (cut to ``max_model_len - 1`` tokens) as a
    ``save_to_disk`` dataset into ``dest``, beside what is there (the ``hidden_states`` folder).
    Each file lands by rename, ``state.json`` last. Returns ``{"rows", "files"}``, each file with
    its size and ``checksum`` digest (for manifest.json; ``verify`` checks them)."""
    import datasets

    from ...files.checksums import file_digest
    from ..dataset import open_dataset

    max_len = max_model_len - 1

    def rows() -> Iterator[dict]:
        for s in islice(open_dataset(input_path), n_samples):
            ids = s.input_ids[:max_len]
            mask = s.loss_mask[:max_len] if s.loss_mask is not None else [1] * len(ids)
            yield {"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)}

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix=".dataset-", dir=dest) as tmp:
        ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=os.path.join(tmp, "cache"))
        if len(ds) != n_samples:
            raise DatasetError(f"{input_path}: {len(ds)} rows, expected {n_samples} (the input changed?)")
        ds = ds.with_format("torch")  # (as speculators' own prepare_data.py saves it)
        staged = Path(tmp) / "dataset"
        ds.save_to_disk(str(staged))
        del ds
        names = sorted(p.name for p in staged.iterdir())
        for old in dest.glob("data-*.arrow"):  # an earlier run's, if it had more files
            if old.name not in names:
                old.unlink()
        (dest / "state.json").unlink(missing_ok=True)  # (no state.json: no dataset, until the new one is whole)
        for name in sorted(names, key=lambda n: n == "state.json"):
            os.replace(staged / name, dest / name)
    files = []
    for name in names:
        rec = {"file": name, "bytes": (dest / name).stat().st_size}
        if checksum != "none":
            rec[checksum] = file_digest(dest / name, checksum)
        files.append(rec)
    return {"rows": n_samples, "files": files}

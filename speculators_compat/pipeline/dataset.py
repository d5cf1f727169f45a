"""Input datasets: JSONL (one sample a line) or a speculators-preprocessed dataset directory
(``datasets.Dataset.save_to_disk`` layout: ``state.json`` + Arrow stream files), read lazily.

Each sample: ``{"input_ids": [int, ...], "loss_mask": [0/1, ...]}`` (loss_mask optional: all ones).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


class DatasetError(ValueError):
    """A malformed input sample; the message names the file and line / row."""


@dataclass
class Sample:
    index: int
    input_ids: list[int]
    loss_mask: list[int] | None


_INT = {int}
_BITS = {0, 1}  # (True == 1 and False == 0 in a set too)
_TEXT_KEYS = {"text", "prompt", "messages", "conversations", "conversation", "content"}


def _validate(where: str, obj) -> tuple[list[int], list[int] | None]:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected an object with input_ids, got {type(obj).__name__}")
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not ids:
        text = sorted(set(obj) & _TEXT_KEYS) if "input_ids" not in obj else []
        hint = (f" (this sample has {', '.join(text)}: the input must be tokenized already, e.g. by "
                "speculators' preprocessing, which writes input_ids and loss_mask)") if text else ""
        raise DatasetError(f"{where}: input_ids must be a non-empty list of token ids{hint}")
    for t in ([] if set(map(type, ids)) == _INT and min(ids) >= 0 else ids):  # (fast path: all good)
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise DatasetError(f"{where}: input_ids holds {t!r}, not a non-negative integer")
    mask = obj.get("loss_mask")
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise DatasetError(f"{where}: loss_mask must be a list as long as input_ids "
                               f"({len(ids)}), got {len(mask) if isinstance(mask, list) else type(mask).__name__}")
        try:
            bits = set(mask) <= _BITS
        except TypeError:  # an unhashable value (a list, a dict) in the mask
            bits = False
        if not bits:
            raise DatasetError(f"{where}: loss_mask must hold 0/1 values")
        if set(map(type, mask)) != _INT:  # floats 0.0/1.0 and booleans become ints
            mask = [int(m) for m in mask]
    return ids, mask


def iter_jsonl(path: Path) -> Iterator[Sample]:
    with open(path, "rb") as f:  # decoded line by line, so a bad byte is named by its line
        index = 0
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a BOM that starts the file is dropped)
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at column {e.start + 1}): "
                                   "the input must be UTF-8 JSON lines") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
            ids, mask = _validate(f"{path}:{lineno}", obj)
            yield Sample(index, ids, mask)
            index += 1


def arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a ``Dataset.save_to_disk`` directory, in order, checked to be there."""
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / f["filename"] for f in state.get("_data_files", [])]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise DatasetError(f"{path / 'state.json'}: not a saved dataset's state file "
                           f"({type(e).__name__}: {e})") from None
    if not files:
        raise DatasetError(f"{path}: state.json lists no data files")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DatasetError(f"{path}: state.json lists data files that are not there: {', '.join(missing)}")
    return files


def _pyarrow(path: Path):
    try:
        import pyarrow as pa
    except ImportError as e:
        raise DatasetError(f"{path}: reading a saved dataset needs pyarrow ({e})") from e
    return pa


def _record_batches(pa, f: Path):
    """A memory-mapped Arrow stream file's record batches (zero-copy); a damaged file is a DatasetError."""
    try:
        with pa.memory_map(str(f)) as src:
            yield from pa.ipc.open_stream(src)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{f}: not a readable Arrow stream ({type(e).__name__}: {e})") from None


def count_arrow_rows(path: Path) -> int:
    """Rows in a saved dataset, counted from its Arrow files' record batches (not from
    ``dataset_info.json``, whose split sizes are those of the dataset it was derived from, before any
    ``select`` / ``filter``)."""
    pa = _pyarrow(path)
    return sum(b.num_rows for f in arrow_files(path) for b in _record_batches(pa, f))


def iter_arrow_dir(path: Path, files: list[Path] | None = None) -> Iterator[Sample]:
    files = arrow_files(path) if files is None else files
    pa = _pyarrow(path)
    index = 0
    for f in files:
        for batch in _record_batches(pa, f):
            cols = batch.schema.names
            if "input_ids" not in cols:
                raise DatasetError(f"{f}: no input_ids column (columns: {cols})")
            ids_col = batch.column("input_ids").to_pylist()
            mask_col = batch.column("loss_mask").to_pylist() if "loss_mask" in cols else [None] * len(ids_col)
            for ids, mask in zip(ids_col, mask_col):
                ids, mask = _validate(f"{f} row {index}", {"input_ids": ids, "loss_mask": mask})
                yield Sample(index, ids, mask)
                index += 1


def open_dataset(path: str | Path) -> Iterator[Sample]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input {str(p)!r} does not exist")
    if p.is_dir():
        if (p / "state.json").exists():  # (its files are checked now, before an engine starts)
            files = arrow_files(p)
            _pyarrow(p)
            return iter_arrow_dir(p, files)
        if (p / "dataset_dict.json").exists():  # DatasetDict.save_to_disk: one sub-directory a split
            try:
                splits = json.loads((p / "dataset_dict.json").read_text()).get("splits") or []
            except (ValueError, AttributeError):
                splits = []
            hint = f"; pass one split's directory, e.g. {str(p / splits[0])!r}" if splits else ""
            raise DatasetError(f"{p}: a saved DatasetDict (splits: {', '.join(map(str, splits)) or 'none listed'}), "
                               f"not one dataset{hint}")
        raise DatasetError(f"{p}: a directory input must be a saved dataset (state.json + .arrow files)")
    return iter_jsonl(p)

"""What an output is (a part of OutputDir): ``run.json``, compared with each run's settings and
fingerprints, what a resume may change, and what only the engine settles."""

from __future__ import annotations

import json
import logging

from ...errors import OutputError
from ...files.formats import SHARD_FILE_RE, atomic_write
from ...files.registry import data_file_index
from .outlock import RANK_DIR_RE

logger = logging.getLogger("speculators_compat.pipeline")


class RunRecord:
    """Part of OutputDir (outdir.py), which holds root, fmt, part, records and checksum."""

    #: run settings a resume may change (run.json keeps the first run's), and what changing them means
    RESUMABLE_CHANGES = {
        "batch_size": "the samples computed now share steps with other neighbours, so their states may "
        "differ in the last bits from an uninterrupted run's (vLLM is not batch-invariant); "
        "they are as right (a lower --batch-size is the way out of a memory error)"
    }

    #: run.json keys that describe the latest run rather than the dataset: rewritten, never compared
    LATEST = ("samples", "skipped_overlength", "input_scan")
    #: what a run.json without the key was made with (written before the setting existed)
    IMPLIED = {"states_dtype": "auto"}

    def check_total(self, total: int) -> None:
        """Refuse a run that reads fewer samples than this output holds files for (a smaller
        ``--max-samples`` over a larger dataset): its manifest would leave those files out."""
        if self.shard_size > 1:
            return
        beyond = sorted(
            i for p in self.root.iterdir() if (i := data_file_index(p.name, self.fmt)) is not None and i >= total
        )
        if beyond:
            raise OutputError(
                f"{self.root} holds files of {len(beyond)} sample(s) at index {total} and above (up to "
                f"{beyond[-1]}), but this run reads {total}: it would leave them out of the dataset. "
                "Leave out --max-samples (or give the earlier one), or use a new --output"
            )

    def _holds_samples(self) -> bool:
        """Whether any run wrote a sample here (a data file or shard, partial or whole, a record, or
        another rank's directory): only then is there a run to protect from other settings."""
        for p in self.root.iterdir():
            name = p.name[1 : -len(".partial")] if p.name.endswith(".partial") else p.name
            if data_file_index(name) is not None or SHARD_FILE_RE.match(name) or RANK_DIR_RE.match(p.name):
                return True
        return bool(self.checksum_records(all_ranks=True))

    def confirm(self, engine_info: dict, record: bool = True) -> None:
        """What only the engine settles (the dtype: "auto" resolved by the engine, an explicit one
        checked before it starts) must match what run.json recorded; with ``record``, a first run
        records it."""
        with self._run_json_lock():  # (the ranks of a sharded run record into one run.json)
            self._confirm(engine_info, record)

    def _confirm(self, engine_info: dict, record: bool) -> None:
        run_file = self.root / "run.json"
        old = json.loads(run_file.read_text())
        diff = {k: (old[k], v) for k, v in engine_info.items() if k in old and old[k] != v}
        if diff:
            detail = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise OutputError(
                f"{self.root} holds a different run ({detail}); resuming would mix states of two runs "
                "in one dataset: use a new --output"
            )
        if record and any(k not in old for k in engine_info):
            atomic_write(run_file, json.dumps({**old, **engine_info}, indent=2, sort_keys=True).encode())

    def _compare(self, old: dict, run_info: dict, fingerprints: dict | None) -> dict:
        """run.json to keep after comparing the recorded run with this one (OutputError if they differ)."""
        from ...checkpoint import describe_model_change
        from ..dataset import describe_input_change

        old = {**self.IMPLIED, **old}
        old_fp = old.get("fingerprints") or {}
        describers = {"model": describe_model_change, "input": describe_input_change}
        same_files = {
            k
            for k in describers
            if fingerprints and k in old_fp and k in fingerprints and not describers[k](old_fp[k], fingerprints[k])
        }
        diff = {k: (old.get(k), v) for k, v in run_info.items() if k in old and old.get(k) != v and k not in same_files}
        # a first run that stopped before its engine started has no dtype yet: not a difference
        diff.update({k: (None, v) for k, v in run_info.items() if k not in old and k != "dtype"})
        diff.pop("world_size", None)
        if old.get("world_size", 1) != run_info.get("world_size", 1):  # (absent: one engine)
            diff["world_size"] = (old.get("world_size", 1), run_info.get("world_size", 1))
        # the parts of a sharded run are cut by batch: every rank must cut the same way
        resumable = self.RESUMABLE_CHANGES if not self.part.sharded and "world_size" not in diff else {}
        for k in [k for k in diff if k in resumable]:
            a, b = diff.pop(k)
            logger.warning(
                "resuming %s with %s %r (the run that made it used %r): %s",
                self.root,
                k,
                b,
                a,
                resumable[k],
            )
        for k in same_files:
            if old.get(k) != run_info.get(k):
                logger.warning(
                    "resuming %s with the %s at %s (the run that made it read %s): the same files, "
                    "by their fingerprint",
                    self.root,
                    k,
                    run_info.get(k),
                    old.get(k),
                )
        changes = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()]
        if fingerprints:
            if not old_fp:
                logger.warning(
                    "%s was made without fingerprints of its model and input: whether they changed "
                    "since cannot be checked; recording them now",
                    self.root,
                )
            for k, describe in describers.items():
                if k in old_fp and k in fingerprints and k not in same_files:
                    changes += [f"{k} {run_info.get(k)}: {c}" for c in describe(old_fp[k], fingerprints[k])]
        if changes:
            if self.part.sharded or old.get("world_size", 1) > 1:
                raise OutputError(
                    f"{self.part.label}: {self.root} holds a sharded run made with other settings "
                    f"({'; '.join(changes)}); every rank must run with the same settings (the run.json "
                    "there), else the parts would not add up to one dataset"
                )
            raise OutputError(
                f"{self.root} holds a different run ({'; '.join(changes)}); resuming would mix "
                "states of two runs in one dataset: use a new --output"
            )
        keep = {k: v for k, v in old.items() if k not in self.LATEST}
        keep.update({k: v for k, v in run_info.items() if k not in keep})
        if fingerprints:
            # (the same files: this run's fingerprint, whose modification times are the files' now)
            keep["fingerprints"] = {**old_fp, **fingerprints}
            keep["model"], keep["input"] = (
                run_info.get("model", old.get("model")),
                run_info.get("input", old.get("input")),
            )
        return keep

"""The end of a run (a part of OutputDir): manifest.json over every complete file, and for a run
in parts, each rank's ``done.json`` and the manifest the last one writes."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ...files.checksums import CHECKSUMS, DEFAULT_CHECKSUM, file_digest
from ...files.formats import atomic_write, shard_name
from ...files.registry import file_name, get_format
from ..ranks import merged_extra
from .layout import Layout

logger = logging.getLogger("speculators_compat.pipeline")

_RUN_KEYS = ("mtime_ns", "durable")  # checksums.jsonl keys that stay out of the manifest


class Manifest:
    """Part of OutputDir (outdir.py), which holds root, fmt, part, records and checksum."""

    def mark_done(self, n_samples: int, extra: dict, summary: dict) -> None:
        """This rank finished its part: ``rank_{K}/done.json`` (after its files are durable)."""
        sync_filesystem(self.root)
        info = {"rank": self.part.rank, "world_size": self.part.world_size, "samples": n_samples, "extra": extra}
        info["summary"] = summary
        atomic_write(self.records / "done.json", json.dumps(info, indent=1, sort_keys=True).encode())

    def ranks_done(self) -> dict[int, dict]:
        """rank -> its done.json, for the ranks of this run that finished their part."""
        out = {}
        for r in range(self.part.world_size):
            try:
                out[r] = json.loads((self.root / f"rank_{r}" / "done.json").read_text())
            except (OSError, ValueError):
                continue
        return out

    def finalize_if_complete(self) -> dict | None:
        """Write the whole dataset's manifest if every rank has finished its part (the last to
        finish does it; under ``.run.lock``, so two finishing together write it once). Returns
        the manifest, or None while ranks are missing."""
        with self._run_json_lock():
            done = self.ranks_done()
            if len(done) < self.part.world_size or (self.root / "manifest.json").exists():
                return None
            return self.finalize(done[0]["samples"], merged_extra(done))

    def finalize(self, n_samples: int, extra: dict) -> dict:
        """Write manifest.json over every complete file (rehashing any missing checksum, e.g. of
        files an earlier run wrote with another algorithm); of a sharded run, every rank's files."""
        sums = self.checksum_records(all_ranks=True)
        files = []
        for i in range(0, n_samples, self.shard_size):
            name = file_name(i, self.fmt) if self.shard_size == 1 else shard_name(i // self.shard_size)
            p = self.root / name
            if not p.exists():
                continue
            rec = sums.get(i)
            algo = self.checksum or DEFAULT_CHECKSUM
            if rec is None or rec.get("bytes") != p.stat().st_size or (algo != "none" and not rec.get(algo)):
                rec = {
                    "index": i,
                    "file": name,
                    "bytes": p.stat().st_size,
                    "tokens": rec.get("tokens") if rec else None,
                    **({"samples": rec["samples"]} if rec and "samples" in rec else {}),
                }
                if algo != "none":
                    rec[algo] = file_digest(p, algo)
            # (a write time and how it was written are the run's, not the dataset's: the manifest
            # of a resumed dataset is byte-identical to an uninterrupted one's)
            rec = {k: v for k, v in rec.items() if (k not in CHECKSUMS or k == algo) and k not in _RUN_KEYS}
            files.append(rec)
        if (
            get_format(self.fmt).sample_lengths
            and self.shard_size == 1
            and all(f.get("tokens") is not None for f in files)
        ):
            # speculators 0.4.x's trainer batches by these lengths (without them it guesses from
            # file sizes); its offline script writes the same file
            lengths = {str(f["index"]): f["tokens"] for f in files}
            atomic_write(self.root / "sample_lengths.json", json.dumps(lengths, indent=1).encode())
        dataset = None
        where = Layout.of_states(self.root, self.fmt).trainer_dataset
        if where is not None:  # its trainer's input_ids/loss_mask dataset (speculators-hs)
            from .trainer_dataset import write_dataset

            run = json.loads((self.root / "run.json").read_text())
            algo = self.checksum or DEFAULT_CHECKSUM
            dataset = write_dataset(where, run["input"], n_samples, run["max_model_len"], algo)
            dataset = {"path": os.path.relpath(where, self.root), **dataset}
        t = time.perf_counter()
        sync_filesystem(self.root)  # the files are durable before the manifest says the dataset is complete
        self.sync_s = time.perf_counter() - t
        manifest = dict(extra)
        if self.shard_size > 1:
            manifest["shard_size"] = self.shard_size
        if dataset is not None:
            manifest["dataset"] = dataset
        manifest.update(
            {
                "format": self.fmt,
                "checksum": self.checksum or DEFAULT_CHECKSUM,
                "num_files": len(files),
                "total_bytes": sum(f["bytes"] for f in files),
                "total_tokens": sum(f["tokens"] or 0 for f in files),
                "files": files,
            }
        )
        atomic_write(self.root / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
        return manifest


def sync_filesystem(path: Path) -> None:
    """Write back the filesystem holding ``path`` (Linux syncfs; elsewhere sync)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass  # (no syncfs here: the portable call below does it for every filesystem)
    os.sync()

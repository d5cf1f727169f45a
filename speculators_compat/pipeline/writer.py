"""Output directory: speculators 0.3.0's layout, written atomically, resumable.

    OUT/data_{i}.pt           {"input_ids": LongTensor[T], "hidden_states": [Tensor[T, H] per layer],
                               "loss_mask": LongTensor[T]}   (torch.save; speculators' trainer reads it)
    OUT/data_{i}.safetensors  the same as safetensors (hidden_states_0..L-1), with --format safetensors
    OUT/run.json              what this output is (model, layer ids, input, versions): a rerun with
                              different settings is refused instead of mixing data
    OUT/checksums.jsonl       one line per finished file: index, name, sha256, bytes, tokens
    OUT/manifest.json         written at the end: counts and every file's checksum, sorted by index

Every data file is written to a temp name (``.data_{i}.pt.partial``: not ``*pt``, so the trainer never
sees it) and renamed into place. A sample is complete iff its final file exists. Writes happen on a
background thread fed by a bounded queue, so disk I/O overlaps the next batch's compute and host
memory holds at most ``queue_size`` batches.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import re
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger("speculators_compat.pipeline")

_DATA_RE = re.compile(r"^data_(\d+)\.(pt|safetensors)$")


class OutputError(RuntimeError):
    pass


def file_name(index: int, fmt: str) -> str:
    return f"data_{index}.{fmt}"


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def writable(self):
        return True

    def write(self, b):
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)


def write_sample(path: Path, sample: dict[str, Any], fmt: str) -> tuple[str, int]:
    """Write ``sample`` atomically to ``path``; returns (sha256, bytes). A sample whose states
    exceed ``SMALL_SAMPLE_BYTES`` streams torch.save into the file through a hash (no in-memory
    copy); a smaller one is serialised in memory and written with one call, which per-file costs
    dominate (tiny model, CPU: 0.74-0.75 vs 0.82-0.83 ms a file). Both give the same bytes."""
    if fmt != "pt" or _payload_bytes(sample) <= SMALL_SAMPLE_BYTES:
        # safetensors, or a small sample: serialise in memory, write once, hash the same bytes
        # (torch.save streaming into a file makes ~64 small writes a file)
        data = _safetensors_bytes(sample) if fmt != "pt" else _torch_bytes(sample)
        atomic_write(path, data)
        return hashlib.sha256(data).hexdigest(), len(data)
    import torch

    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        hf = _HashingFile(f)
        torch.save(sample, hf)
    os.replace(tmp, path)
    return hf.h.hexdigest(), hf.n


def _torch_bytes(sample: dict[str, Any]) -> memoryview:
    import torch

    buf = io.BytesIO()
    torch.save(sample, buf)
    return buf.getbuffer()  # no copy of the serialised bytes


SMALL_SAMPLE_BYTES = 1 << 20


def _payload_bytes(sample: dict[str, Any]) -> int:
    return sum(h.numel() * h.element_size() for h in sample["hidden_states"])


def _safetensors_bytes(sample: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    tensors = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
    for j, h in enumerate(sample["hidden_states"]):
        tensors[f"hidden_states_{j}"] = h.contiguous()
    return save(tensors)


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: a crash leaves either the old state or the whole file


class OutputDir:
    def __init__(self, root: str | Path, fmt: str = "pt"):
        self.root = Path(root)
        self.fmt = fmt

    def prepare(self, run_info: dict) -> set[int]:
        """Create/validate the directory; drop partial files; return indices already complete."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory {self.root}: {e.strerror}") from e
        if not os.access(self.root, os.W_OK):
            raise OutputError(f"output directory {self.root} is not writable")
        run_file = self.root / "run.json"
        if run_file.exists():
            old = json.loads(run_file.read_text())
            diff = {k: (old.get(k), v) for k, v in run_info.items() if old.get(k) != v}
            if diff:
                detail = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
                raise OutputError(f"{self.root} holds a different run ({detail}); use a new --output")
        else:
            atomic_write(run_file, json.dumps(run_info, indent=2, sort_keys=True).encode())
        for p in self.root.glob(".data_*.partial"):
            logger.info("removing partial file %s from an interrupted run", p.name)
            p.unlink()
        done = set()
        for p in self.root.iterdir():
            m = _DATA_RE.match(p.name)
            if m and m.group(2) == self.fmt:
                done.add(int(m.group(1)))
        return done

    def _checksums(self) -> dict[int, dict]:
        out: dict[int, dict] = {}
        f = self.root / "checksums.jsonl"
        if f.exists():
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash: that file gets rehashed below
                out[rec["index"]] = rec
        return out

    def finalize(self, n_samples: int, extra: dict) -> dict:
        """Write manifest.json over every complete file (rehashing any missing checksum)."""
        sums = self._checksums()
        files = []
        for i in range(n_samples):
            name = file_name(i, self.fmt)
            p = self.root / name
            if not p.exists():
                continue
            rec = sums.get(i)
            if rec is None or rec.get("bytes") != p.stat().st_size:
                data = p.read_bytes()
                rec = {"index": i, "file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                       "tokens": rec.get("tokens") if rec else None}
            files.append(rec)
        manifest = dict(extra)
        manifest.update({"format": self.fmt, "num_files": len(files),
                         "total_bytes": sum(f["bytes"] for f in files),
                         "total_tokens": sum(f["tokens"] or 0 for f in files), "files": files})
        atomic_write(self.root / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
        return manifest


def default_writer_threads() -> int:
    """Half the CPUs, 2..8 (1 on one CPU). Each thread streams torch.save through sha256, ~0.6-1
    GiB/s a thread; an H200 host's generate() outruns 4 of them (docs/gpu-results.md)."""
    from ..engine.core import usable_cpus

    cpus = usable_cpus()
    return min(8, max(min(2, cpus), cpus // 2))


class BackgroundWriter:
    """Writes (index, sample) items on a thread; ``queue_size`` bounds what waits in memory."""

    def __init__(self, out: OutputDir, queue_size: int = 2, threads: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.out = out
        self.q: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.error: BaseException | None = None
        self.written = 0
        self.bytes = 0
        self._sums = open(out.root / "checksums.jsonl", "a", encoding="utf-8")
        self._lock = threading.Lock()
        # Files of one batch are written in parallel (hashing and file writes release the GIL);
        # the next batch waits, so memory stays bounded by queue_size + 1 batches.
        n = threads if threads is not None else default_writer_threads()
        if n < 1:
            raise ValueError(f"writer threads must be >= 1, not {n}")
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="speculators-compat-write") if n > 1 else None
        self._t = threading.Thread(target=self._loop, name="speculators-compat-writer", daemon=True)
        self._t.start()

    def put(self, items: list[tuple[int, dict]]) -> None:
        """Queue one batch's samples (blocks while the queue is full); re-raises a writer failure."""
        self.check()
        self.q.put(items)

    def check(self) -> None:
        if self.error is not None:
            raise OutputError(f"writing to {self.out.root} failed: {self.error}") from self.error

    def _loop(self) -> None:
        while True:
            items = self.q.get()
            if items is None:
                return
            if self.error is not None:
                continue  # drain: never block the producer after a failure
            try:
                if self._pool is None:
                    for item in items:
                        self._write_one(item)
                else:
                    for f in [self._pool.submit(self._write_one, item) for item in items]:
                        f.result()  # re-raises the first failure
            except BaseException as e:  # disk full, permissions: surfaced to the producer by check()
                self.error = e

    def _write_one(self, item: tuple[int, dict]) -> None:
        index, sample = item
        name = file_name(index, self.out.fmt)
        digest, nbytes = write_sample(self.out.root / name, sample, self.out.fmt)
        rec = {"index": index, "file": name, "sha256": digest, "bytes": nbytes,
               "tokens": int(sample["input_ids"].numel())}
        with self._lock:
            self._sums.write(json.dumps(rec) + "\n")
            self._sums.flush()
            self.written += 1
            self.bytes += nbytes

    def close(self) -> None:
        self.q.put(None)
        self._t.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._sums.close()
        self.check()

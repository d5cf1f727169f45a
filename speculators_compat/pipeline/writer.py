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

import atexit
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
    if fmt == "pt":
        sample = _unowned_states(sample)
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


def _unowned_states(sample: dict[str, Any]) -> dict[str, Any]:
    """``sample`` with each hidden state replaced by a tensor over the same bytes that owns no
    reference to the original storage.

    torch.save in torch 2.8 and 2.9 (not 2.10 or 2.13: checked) builds a local pickler class per
    call whose closure holds every storage it saved; a class always sits in a reference cycle,
    so those storages stay referenced until the cyclic GC frees that cycle, which may already be
    in the oldest generation by then (seen: the engine's lent rows stayed "busy" after the
    pipeline had dropped them). Saving aliases keeps the caller's storages out of that cycle.
    Only a state whose storage is exactly its bytes is aliased, and one alias per storage, so the
    file is byte-identical to saving the original; the caller holds ``sample`` for the whole
    save, so the memory stays valid while the alias is read, and nothing reads it afterwards."""
    import ctypes

    import torch

    aliases: dict[tuple, Any] = {}  # a tensor listed twice stays one storage in the file

    def alias(h):
        if not isinstance(h, torch.Tensor) or h.device.type != "cpu" or not h.is_contiguous():
            return h
        nbytes = h.numel() * h.element_size()
        if nbytes == 0 or h.storage_offset() != 0 or h.untyped_storage().nbytes() != nbytes:
            return h
        key = (h.data_ptr(), h.dtype, tuple(h.shape))
        if key not in aliases:
            raw = (ctypes.c_ubyte * nbytes).from_address(h.data_ptr())
            aliases[key] = torch.frombuffer(raw, dtype=torch.uint8).view(h.dtype).view(h.shape)
        return aliases[key]

    return {**sample, "hidden_states": [alias(h) for h in sample["hidden_states"]]}


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


class _ChecksumLog:
    """``checksums.jsonl``: one line per finished file, appended as files complete (both writers).
    Not locked: callers serialise ``add``."""

    def __init__(self, out: OutputDir):
        self.fmt = out.fmt
        self.f = open(out.root / "checksums.jsonl", "a", encoding="utf-8")
        self.written = 0

    def add(self, index: int, digest: str, nbytes: int, tokens: int) -> None:
        rec = {"index": index, "file": file_name(index, self.fmt), "sha256": digest, "bytes": nbytes,
               "tokens": tokens}
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.written += 1

    def close(self) -> None:
        self.f.close()


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
        self._sums = _ChecksumLog(out)
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

    @property
    def written(self) -> int:
        return self._sums.written

    def _write_one(self, item: tuple[int, dict]) -> None:
        index, sample = item
        digest, nbytes = write_sample(self.out.root / file_name(index, self.out.fmt), sample, self.out.fmt)
        with self._lock:
            self._sums.add(index, digest, nbytes, int(sample["input_ids"].numel()))

    def close(self) -> None:
        self.q.put(None)
        self._t.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._sums.close()
        self.check()


class WriterProcessDied(OutputError):
    pass


def default_writer_processes() -> int:
    """Half the CPUs, 2..16: each process hashes and writes one file at a time, free of the
    driver's GIL (docs/gpu-results.md section 6)."""
    from ..engine.core import usable_cpus

    return max(2, min(16, usable_cpus() // 2))


def _writer_process_main(task_q, result_q) -> None:
    """A writer process: maps the engine's arena files and writes each sample it is sent.

    A task names where each layer's rows lie ((file, byte offset, rows) in /dev/shm); the rows
    are read in place, so they cross no pipe. The driver keeps them lent (the engine does not
    reuse that memory) until this process reports the file written.
    """
    import gc
    import mmap
    import queue as _q

    import numpy as np
    import torch

    torch.set_num_threads(1)
    parent = os.getppid()
    maps: dict[str, mmap.mmap] = {}
    result_q.put(("ready", os.getpid()))
    while True:
        try:
            task = task_q.get(timeout=2)
        except _q.Empty:
            if os.getppid() != parent:  # the driver died (SIGKILL): nothing left to write for
                return
            continue
        if task is None:
            return
        root, fmt, entries = task
        done = []
        for index, input_ids, loss_mask, blocks, hidden, dtype_name in entries:
            layers = sample = buf = None
            try:
                dtype = getattr(torch, dtype_name)
                layers = []
                for path, off, rows in blocks:
                    mm = maps.get(path)
                    if mm is None:
                        with open(path, "r+b") as f:
                            mm = maps[path] = mmap.mmap(f.fileno(), 0)
                    buf = np.frombuffer(mm, dtype=np.uint8, count=rows * hidden * dtype.itemsize, offset=off)
                    layers.append(torch.from_numpy(buf).view(dtype).view(rows, hidden))
                sample = {"input_ids": torch.from_numpy(input_ids), "hidden_states": layers,
                          "loss_mask": torch.from_numpy(loss_mask)}
                digest, nbytes = write_sample(Path(root) / file_name(index, fmt), sample, fmt)
                done.append((index, digest, nbytes, int(input_ids.size)))
            except BaseException as e:  # reported to the driver, which stops the run
                result_q.put(("ok", done))
                done = []
                result_q.put(("error", index, f"{type(e).__name__}: {e}"))
                break
            finally:
                layers = sample = buf = None
        if done:
            result_q.put(("ok", done))  # one message a chunk: the driver's threads wake up rarely
        gc.collect(1)  # cycles made while writing (write_sample keeps the mapped rows out of torch.save's)
        for p in [p for p in maps if not os.path.exists(p)]:  # the engine released that arena file
            try:
                maps.pop(p).close()
            except BufferError:  # still referenced (cannot happen once the sample is dropped)
                pass


class _WriterPool:
    """Writer processes, started once per driver process and reused by every pipeline run in it
    (starting one costs a torch import, ~1-3 s). Torn down after any failure, so a later run
    never sees an earlier run's results."""

    def __init__(self, n: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        self.n = n
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_writer_process_main, name=f"speculators-compat-write-{i}",
                                  args=(self.tasks, self.results), daemon=True) for i in range(n)]
        for p in self.procs:
            p.start()
        self.lock = threading.Lock()  # one ProcessWriter at a time

    def dead(self):
        return [p for p in self.procs if not p.is_alive()]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for _ in self.procs:
                self.tasks.put(None)
        for p in self.procs:
            if graceful:
                p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.tasks.close()
        self.results.close()


_POOL: _WriterPool | None = None
_POOL_LOCK = threading.Lock()


def writer_pool(n: int | None = None) -> _WriterPool:
    """The process-wide writer pool with ``n`` processes (default: default_writer_processes()),
    started now if it is not running (call early to overlap its start with the engine's)."""
    global _POOL
    n = n if n is not None else default_writer_processes()
    if n < 1:
        raise ValueError(f"writer processes must be >= 1, not {n}")
    with _POOL_LOCK:
        if _POOL is not None and (_POOL.n != n or _POOL.dead()):
            _POOL.close(graceful=not _POOL.dead())
            _POOL = None
        if _POOL is None:
            _POOL = _WriterPool(n)
        return _POOL


def shutdown_writer_pool(graceful: bool = True) -> None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close(graceful)
            _POOL = None


atexit.register(shutdown_writer_pool)  # let the processes finish and exit before the interpreter


class ProcessWriter:
    """Writes samples in separate processes, free of the driver's GIL.

    Why: the engine's driver thread spins on vLLM's shared-memory queue while the GPU works, and
    writer *threads* then wait on the GIL: on an H200 host the thread writer managed ~2.7 GiB/s
    in the pipeline against 6.2 GiB/s alone. Samples whose rows are lent arena blocks (the
    engine's zero-copy hand-off) travel as (file, offset, rows); the rest (rows split over
    several engine steps) are written on a local thread. The driver holds every sample until its
    file is written, so the engine cannot reuse those rows meanwhile, and at most
    ``queue_size + 1`` batches are in flight (bounded memory, as BackgroundWriter).
    Same files, same bytes, same checksums.jsonl as BackgroundWriter.
    """

    def __init__(self, out: OutputDir, describe, queue_size: int = 2, processes: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = writer_pool(processes)
        if not self.pool.lock.acquire(timeout=60):
            raise OutputError("another pipeline in this process is using the writer processes")
        self.out, self.describe, self.limit = out, describe, max(1, queue_size) + 1
        self.error: BaseException | None = None
        self.in_processes = 0  # samples sent as (file, offset, rows) to a writer process
        self.on_threads = 0  # samples written on the local thread (rows not lent)
        self._sums = _ChecksumLog(out)
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[int, dict]] = {}  # index -> (batch, sample), until written
        self._batches: dict[int, int] = {}  # batch -> samples not yet written
        self._nbatch = 0
        self._closing = False
        self._local = ThreadPoolExecutor(max_workers=2, thread_name_prefix="speculators-compat-write")
        self._collector = threading.Thread(target=self._collect, name="speculators-compat-collect", daemon=True)
        self._collector.start()

    # -------------------------------------------------------------- producer side
    def check(self) -> None:
        if self.error is not None:
            raise OutputError(f"writing to {self.out.root} failed: {self.error}") from self.error

    def put(self, items: list[tuple[int, dict]]) -> None:
        """Queue one batch's samples (blocks while ``queue_size + 1`` batches are in flight)."""
        import numpy as np

        with self._cv:
            while self.error is None and len(self._batches) >= self.limit:
                self._cv.wait(0.5)
            self.check()
            if not items:
                return
            batch = self._nbatch
            self._nbatch += 1
            self._batches[batch] = len(items)
            for index, sample in items:
                self._pending[index] = (batch, sample)
        entries = []
        for index, sample in items:
            blocks = [self.describe(h) for h in sample["hidden_states"]]
            if all(b is not None for b in blocks):
                h0 = sample["hidden_states"][0]
                entries.append((index, np.ascontiguousarray(sample["input_ids"].numpy()),
                                np.ascontiguousarray(sample["loss_mask"].numpy()), blocks,
                                int(h0.shape[-1]), str(h0.dtype).replace("torch.", "")))
            else:
                self._local.submit(self._write_local, index, sample)
                self.on_threads += 1
        # one task per process and batch (not per sample): every message costs the driver's
        # feeder and collector threads a turn at the GIL, which the engine loop's spin-wait holds
        per = -(-len(entries) // len(self.pool.procs)) if entries else 1
        for k in range(0, len(entries), per):
            self.pool.tasks.put((str(self.out.root), self.out.fmt, entries[k:k + per]))
        self.in_processes += len(entries)

    def _write_local(self, index: int, sample: dict) -> None:
        try:
            digest, nbytes = write_sample(self.out.root / file_name(index, self.out.fmt), sample, self.out.fmt)
            self._done(index, digest, nbytes, int(sample["input_ids"].numel()))
        except BaseException as e:
            self._fail(e)

    # -------------------------------------------------------------- results
    @property
    def written(self) -> int:
        return self._sums.written

    def _done(self, index: int, digest: str, nbytes: int, tokens: int) -> None:
        with self._cv:
            if index not in self._pending:  # not ours (cannot happen: the pool restarts after a failure)
                raise OutputError(f"writer process reported sample {index}, which this run did not send")
            self._sums.add(index, digest, nbytes, tokens)
            batch, _ = self._pending.pop(index)  # drops the sample: its rows may be reused
            self._batches[batch] -= 1
            if not self._batches[batch]:
                del self._batches[batch]
            self._cv.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = e
            self._cv.notify_all()

    def _collect(self) -> None:
        import queue as _q

        while True:
            with self._cv:
                if self.error is not None or (self._closing and not self._pending):
                    return
            try:
                msg = self.pool.results.get(timeout=0.5)
            except _q.Empty:
                dead = self.pool.dead()
                if dead:
                    self._fail(WriterProcessDied(
                        f"writer process {dead[0].name} (pid {dead[0].pid}) died with exit code "
                        f"{dead[0].exitcode}; files already written are complete, rerun to resume"))
                continue
            try:
                if msg[0] == "ok":
                    for rec in msg[1]:
                        self._done(*rec)
                elif msg[0] == "error":
                    self._fail(OutputError(f"writing sample {msg[1]} failed: {msg[2]}"))
            except BaseException as e:  # never leave close() waiting on a dead collector
                self._fail(e)

    def close(self) -> None:
        """Wait for every queued sample (or the first failure), release the pool, re-raise."""
        try:
            with self._cv:
                self._closing = True
                while self.error is None and self._pending:
                    self._cv.wait(0.5)
            self._collector.join()
            self._local.shutdown(wait=True)
            self._sums.close()
            if self.error is not None:  # tasks of this run may still be queued: start afresh next time
                shutdown_writer_pool(graceful=False)
            with self._cv:
                self._pending.clear()
        finally:
            self.pool.lock.release()
        self.check()

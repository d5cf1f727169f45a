"""The driver's side of the worker -> driver hand-off of captured rows.

The worker writes each batch's rows into arena slabs, files in /dev/shm (worker.py / arena.py);
this module names those files (a per-engine prefix), marks them as in use with a lock file so that
an engine killed with SIGKILL leaves nothing behind for long (the next engine's sweep removes
them), and maps them in the driver (``ArenaReader``), turning each request's blocks into tensors:
lent (a tensor over the mapping, no copy) or copied out. ``SPECULATORS_COMPAT_HANDOFF=rpc`` sends
the rows pickled through vLLM's RPC instead (no /dev/shm).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from .. import envs
from ..host import cuda_device_count, usable_cpus

logger = logging.getLogger("speculators_compat.engine")


FULL_GC_SPACING = 50  # a full GC for lent rows held by garbage cycles: at most 1/50 of the time (see busy())


def handoff_prefix(uid: str) -> str | None:
    """The path prefix of this engine's arena files, or None when the rows travel over RPC."""
    if envs.get("SPECULATORS_COMPAT_HANDOFF") == "rpc":
        return None
    d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if d is None:
        logger.warning("speculators_compat: /dev/shm is not writable; captured states travel over RPC (slower)")
        return None
    sweep_stale_handoff_files(d)
    return os.path.join(d, f"speculators-compat-{uid}-")


LOCK_SUFFIX = "lock"


def hold_handoff_lock(prefix: str) -> int:
    """Create ``<prefix>lock`` and hold an exclusive flock on it for the engine's life (the fd is
    returned; closing it, or the process dying, releases it). The lock, not a pid, marks the files
    under ``prefix`` as in use: it holds across pid namespaces (containers sharing /dev/shm)."""
    from ..host import hold_exclusive

    return hold_exclusive(prefix + LOCK_SUFFIX, 0o600)


def sweep_stale_handoff_files(d: str) -> list[str]:
    """Remove the hand-off files of engines that are gone: a driver killed with SIGKILL cannot clean
    up, and its arena files would hold /dev/shm memory until reboot. A group of files is stale
    when its lock file exists and nobody holds the lock; a group without a lock file (an older
    release's) is left alone."""
    import fcntl

    removed: list[str] = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for lock in [n for n in names if n.startswith("speculators-compat-") and n.endswith("-" + LOCK_SUFFIX)]:
        prefix = lock[: -len(LOCK_SUFFIX)]
        try:
            fd = os.open(os.path.join(d, lock), os.O_RDWR)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: that engine is alive
            for n in names:
                if n.startswith(prefix) and n != lock:
                    try:
                        os.unlink(os.path.join(d, n))
                        removed.append(n)
                    except FileNotFoundError:
                        pass
            os.unlink(os.path.join(d, lock))  # last, while we hold it
            removed.append(lock)
        finally:
            os.close(fd)
    if removed:
        logger.info("speculators_compat: removed %d hand-off file(s) of engines that are gone from %s", len(removed), d)
    return removed


def auto_copy_threads(host_alloc: str) -> int:
    """8 threads (at most half the CPUs) where the copies land in reused pinned pages (GPU hosts,
    where they were faster than one: docs/benchmarks.md); 1 elsewhere (into fresh pages more
    threads contend on page faults, and a CPU engine needs the cores itself)."""
    if host_alloc != "pinned":
        return 1
    return max(1, min(8, usable_cpus() // 2))


class ArenaReader:
    """Driver side of the /dev/shm hand-off: maps the worker's arena files and turns its blocks
    into tensors.

    Every returned tensor has a storage of its own holding exactly its rows (so ``torch.save`` of
    one layer of one sample writes just that). Two ways to get there:

    * lending (``lend``, the default): a (request, layer) whose rows are one block in the arena
      (every prompt: the worker gives each one a region of its own, also when the scheduler splits
      it over steps) becomes a tensor over the driver's mapping of that block, no copy. Its arena
      file is then *busy*: the worker is told so with every batch and never refills it until every
      tensor over it is gone (counted with a finaliser on each lent buffer). Rows in several blocks
      (a step that fell back to a block of its own) are copied (joined).
    * copying (``lend=False``): every tensor is a fresh copy and the worker refills one arena each
      batch.

    Copies land in pinned memory from torch's caching allocator on a GPU host (it hands the same
    pages back call after call; fresh pages cost a page fault each, which at GPU rates dominates
    the copy), in plain memory elsewhere, on ``auto_copy_threads`` threads.
    """

    def __init__(self, lend: bool = True, threads: int | None = None):
        self._maps: dict[str, Any] = {}  # path -> [mmap, uint8 tensor over it]
        self._lent: dict[str, int] = {}  # path -> live lent buffers
        self._blocks: dict[int, tuple] = {}  # storage address of a live lent buffer -> (path, offset, bytes)
        self._lent_lock = threading.RLock()  # a finaliser may run (GC) while this thread holds it
        self._next_full_gc = 0.0  # see busy()
        self.full_collections = 0
        self._pool = None
        self.mode = "pinned" if cuda_device_count() > 0 else "malloc"
        self.lend = bool(lend)
        self.threads = 1
        self.set_threads(auto_copy_threads(self.mode) if threads is None else threads)

    def set_threads(self, n: int) -> None:
        """Copy with ``n`` threads (one request's layers per task; torch releases the GIL while it
        copies)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"copy threads must be a positive integer, not {n!r}")
        if self._pool is not None and n != self.threads:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.threads = n

    def _empty(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=self.mode == "pinned")

    def _map(self, path: str):
        m = self._maps.get(path)
        if m is None:
            import mmap

            import torch

            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            m = self._maps[path] = [mm, torch.frombuffer(mm, dtype=torch.uint8)]
        return m

    def busy(self, slabs=None) -> list[str]:
        """Arena files some lent tensor still lives in (the worker must not refill them).

        ``slabs``: the worker's arena files as of its last reply, when known. If one of them is
        free, the worker has somewhere to write the next batch, and nothing is collected now (a
        pipeline holds the last batch's rows in its write queue on purpose; collecting every
        call found nothing to free and cost a measurable share of the pipeline). Otherwise:

        A dropped tensor can still be referenced from a garbage reference cycle (torch.save in
        torch 2.8-2.9 makes one per call that holds every storage it saved; so can the caller's
        code), and such a cycle may already sit in the oldest GC generation. When anything is
        busy the young generations are collected (cheap); when something is still busy, a full
        collection runs too, at most once per ``FULL_GC_SPACING`` times its own last duration
        (so it costs at most ~1/FULL_GC_SPACING of the run, e.g. when the caller keeps every
        result). Without it such slabs stay busy until Python's own full collection, and the
        worker grows its arena meanwhile."""
        busy = self._busy_now()
        if busy and slabs is not None and not set(slabs) <= set(busy):
            return busy
        if busy:
            import gc

            gc.collect(1)
            busy = self._busy_now()
            now = time.monotonic()
            if busy and now >= self._next_full_gc:
                gc.collect()
                done = time.monotonic()
                self._next_full_gc = done + FULL_GC_SPACING * (done - now)
                self.full_collections += 1
                busy = self._busy_now()
        return busy

    def _busy_now(self) -> list[str]:
        with self._lent_lock:
            return [p for p, n in self._lent.items() if n > 0]

    def _returned(self, path: str, ptr: int) -> None:  # a lent buffer died (any thread)
        with self._lent_lock:
            self._lent[path] -= 1
            self._blocks.pop(ptr, None)

    def describe(self, t) -> tuple | None:
        """(arena file, byte offset, rows) when ``t`` is exactly a lent block (another process can
        map it there instead of receiving the bytes); None for anything else."""
        try:
            ptr = t.untyped_storage().data_ptr()
        except (AttributeError, RuntimeError):
            return None
        with self._lent_lock:
            blk = self._blocks.get(ptr)
        if (
            blk is None
            or t.dim() != 2
            or t.storage_offset() != 0
            or not t.is_contiguous()
            or t.numel() * t.element_size() != blk[2]
        ):
            return None
        return blk[0], blk[1], int(t.shape[0])

    def _lend_block(self, path: str, off: int, rows: int, hidden: int, dtype):
        import weakref

        import numpy as np
        import torch

        nbytes = rows * hidden * dtype.itemsize
        buf = np.frombuffer(self._map(path)[0], dtype=np.uint8, count=nbytes, offset=off)
        ptr = buf.ctypes.data
        with self._lent_lock:
            self._lent[path] = self._lent.get(path, 0) + 1
            self._blocks[ptr] = (path, off, nbytes)
        weakref.finalize(buf, self._returned, path, ptr)
        # the tensor's storage is exactly this block and keeps ``buf`` (and so the mapping) alive
        return torch.from_numpy(buf).view(dtype).view(rows, hidden)

    def assemble(self, blocks, hidden: int, dtype):
        """An entry's rows: its arena blocks [(file, byte offset, rows)] lent or copied into a
        tensor; a tensor (rows a worker without the driver's /dev/shm sent over RPC) as it is."""
        import torch

        if isinstance(blocks, torch.Tensor):
            return blocks
        if self.lend and len(blocks) == 1:
            return self._lend_block(*blocks[0], hidden, dtype)
        es = dtype.itemsize
        views = [self._map(p)[1][o : o + n * hidden * es].view(dtype).view(n, hidden) for p, o, n in blocks]
        out = self._empty((sum(v.shape[0] for v in views), hidden), dtype)
        return torch.cat(views, dim=0, out=out) if len(views) > 1 else out.copy_(views[0])

    def assemble_all(self, states: dict, hidden: int, dtype, shapes: list | None = None) -> dict:
        """``{request: [tensor per entry]}`` from ``{request: [blocks per entry]}``; every entry is
        ``hidden`` wide in ``dtype``, unless ``shapes`` gives each its own (row width, dtype)."""
        for layers in states.values():  # map every file here, so the worker threads only read
            for blocks in layers:
                for p, _, _ in blocks if isinstance(blocks, list) else ():
                    self._map(p)

        def one(layers):
            kinds = shapes or [(hidden, dtype)] * len(layers)
            return [self.assemble(b, w, dt) for b, (w, dt) in zip(layers, kinds)]

        copies = sum(
            1 for layers in states.values() for b in layers if isinstance(b, list) and not (self.lend and len(b) == 1)
        )
        if self.threads == 1 or copies < 2:
            return {r: one(layers) for r, layers in states.items()}
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sc-copy")
        futs = {r: self._pool.submit(one, layers) for r, layers in states.items()}
        return {r: f.result() for r, f in futs.items()}

    def forget_except(self, live) -> None:
        """Drop the mappings of arena files the worker no longer has (a lent tensor keeps its own
        mapping alive until it dies)."""
        live = set(live)
        for p in [p for p in self._maps if p not in live]:
            del self._maps[p]
        with self._lent_lock:
            for p in [p for p, n in self._lent.items() if n <= 0 and p not in live]:
                del self._lent[p]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._maps.clear()

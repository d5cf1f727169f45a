"""The worker's host arena: the slabs the capture hooks write each batch's rows into.

A slab is a file in /dev/shm (the driver maps it: handoff.py) or, with the RPC hand-off, process
memory; on a GPU it is page-locked so that device->host copies into it are asynchronous DMAs.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import torch

from ..errors import ArenaSpaceError
from . import ARENA_HEADROOM

logger = logging.getLogger("speculators_compat.worker")
SHM_ALIGN = 64  # bytes; every block in the arena starts aligned (any dtype, vectorised copies)


class Arena:
    """Host buffers ("slabs") the capture hooks write rows into; one slab is filled per batch.

    With ``prefix`` each slab is a file in /dev/shm (space reserved with posix_fallocate, so a
    full /dev/shm is a clear error here instead of a SIGBUS in a forward); without one it is
    process memory and the rows travel back pickled. ``pin``: register the slabs with CUDA so
    device->host copies into them are asynchronous DMAs.

    Lending: the driver may hand rows out to its caller without copying them (tensors over its
    mapping of the slab). Such a slab is *busy* until the driver reports that every tensor in it
    is gone; :meth:`prepare` never fills a busy slab, it takes a free one or makes a new one.
    Slabs are keyed by a serial number that is never reused, so a stale key cannot alias.
    """

    SPARE = 2  # free slabs kept besides the one being filled...
    RECENT = 8  # ...or as many as were in use at once within the last RECENT batches...
    KEEP_S = 30.0  # ...and the last KEEP_S seconds: a burst of quick calls that hold nothing must not
    # release the slabs a write queue needs again seconds later; a new one is a /dev/shm allocation
    # plus page-locking (0.1 s or more for half a GB on a GPU host)
    HEADROOM = ARENA_HEADROOM  # a slab made for a batch is sized to the largest batch seen so far times
    # this, so batches of mixed sizes soon fit the slabs already made; falls back to the exact size
    # where /dev/shm has no room for the headroom

    def __init__(self, prefix: str | None, pin: bool):
        self.prefix, self.pin = prefix, pin
        self.slabs: dict[int, list] = {}  # serial -> [path | None, uint8 tensor, pinned?]
        self.cur: int | None = None  # the slab being filled
        self.used = 0
        self._n = 0
        self.peak_need = 0  # the largest batch (bytes) prepare() was asked for
        self._in_use: deque = deque(maxlen=4096)  # (monotonic time, slabs in use) of recent batches
        self.keep_s = self.KEEP_S
        # slabs the caller will hold at once (a pipeline: its write queue plus the batch being
        # filled), made together instead of one each time its writers fall a batch further behind
        # (each one costs the engine a slab's allocation and page-locking); 0: made as needed
        self.want = 0
        self.t_new = 0.0  # seconds spent making slabs (allocating, mapping, page-locking)

    @property
    def capacity(self) -> int:
        return self.slabs[self.cur][1].numel() if self.cur is not None else 0

    @property
    def total_bytes(self) -> int:
        return sum(s[1].numel() for s in self.slabs.values())

    def paths(self) -> list:
        return [s[0] for s in self.slabs.values() if s[0] is not None]

    def prepare(self, need: int, busy=(), want: int | None = None) -> None:
        """Start a batch of up to ``need`` bytes in a slab whose file is not in ``busy`` (paths the
        driver still lends out). Free slabs that fit are kept for later batches (a pipeline that
        holds a few batches in its write queue reuses them instead of page-locking new ones), up
        to the recent peak of slabs in use at once, at least ``SPARE``; the rest are released.
        ``want`` (kept until changed): have that many slabs in all, making the missing ones now."""
        if want is not None:
            self.want = max(0, int(want))
        busy = set(busy)
        free = [k for k, s in self.slabs.items() if s[0] not in busy]
        in_use = len(self.slabs) - len(free) + 1
        now = time.monotonic()
        # the slabs asked for count as in use: kept through the same windows once the ask ends (plain
        # generate() calls between pipeline runs would otherwise release slabs the next run makes again)
        self._in_use.append((now, max(in_use, self.want)))
        while len(self._in_use) > self.RECENT and now - self._in_use[0][0] > self.keep_s:
            self._in_use.popleft()  # older than both windows
        peak = max(n for _, n in self._in_use)
        fits = sorted((k for k in free if self.slabs[k][1].numel() >= need), key=lambda k: self.slabs[k][1].numel())
        chosen = fits[0] if fits else None
        keep = set(fits[: 1 + max(self.SPARE, peak - in_use)])  # (peak counts the slabs asked for)
        for k in free:
            if k not in keep:
                self._release(self.slabs.pop(k))
        self.peak_need = max(self.peak_need, need)
        if chosen is None:
            chosen = self._new_with_headroom(need)
        self.cur, self.used = chosen, 0
        self._provision(need)

    def _provision(self, need: int) -> None:
        """Make slabs (with headroom) until there are ``want``; stop at the first that finds no
        room in /dev/shm (logged): the batches that need one later get the usual clear error."""
        while need and len(self.slabs) < self.want:
            try:
                self._new(self._roomy(need))
            except ArenaSpaceError as e:
                logger.info(
                    "speculators_compat: made %d of the %d hand-off slabs asked for ahead; "
                    "the rest are made when needed (%s)",
                    len(self.slabs),
                    self.want,
                    e,
                )
                self.want = len(self.slabs)
                return

    def _roomy(self, need: int) -> int:
        """A new slab's size: the largest batch seen (or this one) with headroom."""
        return int(max(need, self.peak_need) * self.HEADROOM)

    def _new_with_headroom(self, need: int) -> int:
        roomy = self._roomy(need)
        if roomy > need:
            try:
                return self._new(roomy)
            except ArenaSpaceError:
                logger.info(
                    "speculators_compat: no room for a %.0f MiB hand-off slab; making one of exactly %.0f MiB",
                    roomy / 2**20,
                    need / 2**20,
                )
        return self._new(need)

    def reserve(self, nbytes: int, live=None, busy=()) -> None:
        """Make room for ``nbytes`` more while other requests' rows are still in the arena (outside
        any forward). ``live``: the slabs those rows are in, when known (continuous batching:
        stream.py); then a slab none of them is in (nor in ``busy``) is filled again, the smallest
        that fits, and unused ones beyond ``SPARE`` are released, so the arena stays at what is in
        flight. Else a new slab, twice the current one."""
        if self.used + nbytes <= self.capacity:
            return
        if live is None:
            self.cur, self.used = self._new(max(nbytes, 2 * self.capacity)), 0
            return
        skip = set(busy)
        unused = [k for k, s in self.slabs.items() if k != self.cur and k not in live and s[0] not in skip]
        fits = sorted((k for k in unused if self.slabs[k][1].numel() >= nbytes), key=lambda k: self.slabs[k][1].numel())
        chosen = fits[0] if fits else self._new_with_headroom(nbytes)
        for k in [k for k in unused if k != chosen][self.SPARE :]:
            self._release(self.slabs.pop(k))
        self.cur, self.used = chosen, 0

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """(slab, byte offset) of a fresh ``nbytes`` block."""
        nbytes = -(-nbytes // SHM_ALIGN) * SHM_ALIGN
        if self.used + nbytes > self.capacity:
            # the new slab starts empty; earlier ones keep their rows (this batch refers to them)
            self.cur, self.used = self._new(max(nbytes, 2 * self.capacity)), 0
        off = self.used
        self.used += nbytes
        return self.cur, off

    def view(self, idx: int, off: int, rows: int, hidden: int, dtype) -> torch.Tensor:
        es = dtype.itemsize
        return self.slabs[idx][1][off : off + rows * hidden * es].view(dtype).view(rows, hidden)

    def path(self, idx: int):
        return self.slabs[idx][0]

    def pinned(self, idx: int) -> bool:
        return self.slabs[idx][2]

    def _new(self, need: int) -> int:
        t0 = time.perf_counter()
        try:
            return self._make(need)
        finally:
            self.t_new += time.perf_counter() - t0

    def _make(self, need: int) -> int:
        size = max(need, 1 << 20)
        size = -(-size // 4096) * 4096
        self._n += 1
        path = None
        if self.prefix is None:
            t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            buf = [None, t, self.pin]
        else:
            path = f"{self.prefix}arena{self._n}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                lent = sum(1 for s in self.slabs.values() if s[0] is not None)
                raise ArenaSpaceError(
                    f"speculators_compat: cannot reserve {size / 2**20:.0f} MiB in {os.path.dirname(path)} "
                    f"for captured hidden states ({e.strerror}; {lent} slab(s) of "
                    f"{self.total_bytes / 2**20:.0f} MiB already there, incl. states of earlier batches "
                    "still referenced by the caller). Give it more room (docker: --shm-size or --ipc=host), "
                    "lower the batch, drop or .clone() results you keep, or set "
                    "SPECULATORS_COMPAT_HANDOFF=rpc"
                ) from e
            os.close(fd)
            t = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            buf = [path, t, False]
            if self.pin:
                buf[2] = _host_register(t)
        self.slabs[self._n] = buf
        return self._n

    def _release(self, buf) -> None:
        path, t, pinned = buf
        if pinned and path is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        buf[1] = None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for buf in self.slabs.values():
            self._release(buf)
        self.slabs = {}
        self.cur, self.used = None, 0


def _host_register(t: torch.Tensor) -> bool:
    """Page-lock a mapped hand-off file for the GPU (async DMA into it). False: copies stay synchronous."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    code = getattr(rc, "value", rc)
    if code != 0:
        logger.warning(
            "speculators_compat: cudaHostRegister of the hand-off arena failed (%s); "
            "device->host copies of captured states will be synchronous",
            rc,
        )
        return False
    return True

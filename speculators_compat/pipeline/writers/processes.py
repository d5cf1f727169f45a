"""Writer processes, the driver's side (a process's own: process_child.py): the pipeline's files
written in processes of their own (``--writer process``, the default on GPU hosts), which map the
engine's lent arena blocks themselves, so no hidden state crosses a pipe and no driver thread
competes for the GIL with the driver's own spinning thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from ...engine.fp8 import SCALES_KEY
from ...errors import OutputError, WriterProcessDied
from ...files import ptfile
from ...files.formats import write_sample
from ...files.registry import file_name
from ...files.stages import StageTimes
from ...host import cuda_device_count, usable_cpus
from ..output.outdir import OutputDir
from .process_child import _FRAME, SampleTask, WriteTask, _writer_process_main
from .threads import ChecksumLog, Writer

logger = logging.getLogger("speculators_compat.pipeline")

# ------------------------------------------------------------------ writer processes
#
# The driver talks to each writer process over two pipes of its own and no helper thread: the
# driver's thread spins on vLLM's reply queue while the engine works, and any other thread of the
# driver that needs the GIL (a multiprocessing.Queue feeder, a result collector) then waits for
# the interpreter's forced switch (5 ms each time) behind it. Tasks are written by the caller
# itself, without blocking (what does not fit in the pipe is kept and written at the next
# chance); results are read by the caller when it queues the next batch (right before the next
# engine call, which is when the engine needs to know which rows are free) or waits.

PIPE_BYTES = 1 << 20  # asked for each task pipe (Linux: F_SETPIPE_SZ, up to pipe-max-size)

_POOL: _WriterPool | None = None
_POOL_LOCK = threading.Lock()


def _died(proc, exitcode) -> WriterProcessDied:
    return WriterProcessDied(
        f"writer process {proc.name} (pid {proc.pid}) died with exit code {exitcode}; "
        "files already written are complete, rerun to resume"
    )


def default_writer_processes(gpu_workers: int | None = None) -> int:
    """On a GPU host, every CPU but two (the driver, and one spare for the read-ahead thread, the
    kernel's writeback and whatever else the host runs) and one per engine worker (the driver and
    the workers spin while the GPUs work), 2..16: fewer left the pipeline behind ``generate()``,
    one more gained nothing (docs/benchmarks.md). ``gpu_workers`` is the engine's
    tensor-parallel size (default 1). Elsewhere half the CPUs, 2..16: a CPU engine needs its
    cores."""

    cpus = usable_cpus()
    if cuda_device_count() > 0:
        return max(2, min(16, cpus - 2 - (gpu_workers or 1)))
    return max(2, min(16, cpus // 2))


def _grow_pipe(fd: int) -> int:
    """Make the pipe at ``fd`` hold PIPE_BYTES if the OS lets us; returns its size (0 if unknown)."""
    import fcntl

    setsz = getattr(fcntl, "F_SETPIPE_SZ", None)
    getsz = getattr(fcntl, "F_GETPIPE_SZ", None)
    if setsz is None:
        return 0
    for size in (PIPE_BYTES, 1 << 18, 1 << 16):
        try:
            fcntl.fcntl(fd, setsz, size)
            break
        except OSError:  # above /proc/sys/fs/pipe-max-size: try smaller
            continue
    return fcntl.fcntl(fd, getsz) if getsz is not None else 0


@dataclass
class InFlight:
    """A sample handed to the writers and not yet written: the driver holds it (so its rows are
    not reused) until its file is recorded."""

    batch: int
    sample: dict
    proc: Any = None  # the _WriterProc writing it; None: a local thread
    size: int = 0  # its states' bytes, counted in that process's load


class _WriterProc:
    """One writer process and the driver's ends of its two pipes."""

    def __init__(self, ctx, i: int):
        task_r, self.task_w = ctx.Pipe(duplex=False)
        self.results, result_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_writer_process_main, name=f"speculators-compat-write-{i}", args=(task_r, result_w), daemon=True
        )
        self.proc.start()
        task_r.close()  # the child's ends: when the driver dies, the child reads end-of-file
        result_w.close()
        self.fd = self.task_w.fileno()
        self.pipe_bytes = _grow_pipe(self.fd)
        os.set_blocking(self.fd, False)
        self.outbox = bytearray()  # framed tasks not yet in the pipe
        self.load = 0  # bytes of states sent and not yet reported written
        self.answered = False  # it has sent something back: started (torch imported), reading tasks

    def send(self, obj) -> None:
        import pickle

        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.outbox += len(body).to_bytes(_FRAME, "little") + body
        self.flush()

    def flush(self) -> bool:
        """Write what the pipe takes now; True when nothing is left to write."""
        while self.outbox:
            try:
                n = os.write(self.fd, self.outbox)
            except BlockingIOError:
                return False
            except BrokenPipeError:  # the process died: reported by the caller's liveness check
                self.outbox.clear()
                return True
            del self.outbox[:n]
        return True


class _WriterPool:
    """Writer processes, started once per driver process and reused by every pipeline run in it
    (starting one costs a torch import, ~1-3 s). Torn down after any failure, so a later run
    never sees an earlier run's results."""

    def __init__(self, n: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        self.n = n
        self.pt_writer = ptfile.mode()  # (the processes read it from the environment as they start)
        self.procs = [_WriterProc(ctx, i) for i in range(n)]
        self.lock = threading.Lock()  # one ProcessWriter at a time
        self.broken = False  # a process of it died during a run: never reused

    def dead(self):
        return [w.proc for w in self.procs if not w.proc.is_alive()]

    def wait_ready(self, timeout: float = 120) -> None:
        """Block until every process has started and answers (a process spends ~1-3 s importing
        torch first). Only between runs: it takes the pool's lock."""
        import time
        from multiprocessing.connection import wait

        if not self.lock.acquire(timeout=timeout):
            raise OutputError("writer processes are busy with a run")
        try:
            for w in self.procs:
                w.send("ping")
            deadline = time.monotonic() + timeout
            waiting = {w.results: w for w in self.procs}
            while waiting:
                for w in self.procs:
                    w.flush()
                ready = wait(list(waiting), max(0.0, deadline - time.monotonic()))
                if not ready:
                    names = ", ".join(w.proc.name for w in waiting.values())
                    raise OutputError(f"writer processes did not start within {timeout} s: {names}")
                for conn in ready:
                    w = waiting.pop(conn)
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        raise WriterProcessDied(
                            f"writer process {w.proc.name} died at start-up (exit code {w.proc.exitcode})"
                        ) from None
                    if msg[0] != "pong":
                        raise OutputError(f"writer process {w.proc.name} answered {msg[0]!r} to a ping")
                    w.answered = True
        finally:
            self.lock.release()

    def close(self, graceful: bool = True) -> None:
        import time

        if graceful:
            deadline = time.monotonic() + 10
            for w in self.procs:
                try:
                    w.send(None)
                    while not w.flush() and time.monotonic() < deadline and w.proc.is_alive():
                        time.sleep(0.005)
                except OSError:
                    pass
        for w in self.procs:
            if graceful:
                w.proc.join(timeout=10)
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=5)
            w.task_w.close()
            w.results.close()


def writer_pool(n: int | None = None, gpu_workers: int | None = None) -> _WriterPool:
    """The process-wide writer pool with ``n`` processes (default: default_writer_processes()),
    started now if it is not running (call early to overlap its start with the engine's)."""
    global _POOL
    n = n if n is not None else default_writer_processes(gpu_workers)
    if n < 1:
        raise ValueError(f"writer processes must be >= 1, not {n}")
    pt_writer = ptfile.mode()  # a bad setting is an error here, not a dead writer process
    with _POOL_LOCK:
        if _POOL is not None and (_POOL.n != n or _POOL.broken or _POOL.dead() or _POOL.pt_writer != pt_writer):
            _POOL.close(graceful=not (_POOL.broken or _POOL.dead()))
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


class ProcessWriter(Writer):
    """Writes samples in separate processes, free of the driver's GIL.

    Why: the engine's driver thread spins on vLLM's shared-memory queue while the GPU works, and
    writer *threads* then wait on the GIL, at a fraction of what they write alone
    (docs/benchmarks.md). Samples whose rows are lent arena blocks (the
    engine's zero-copy hand-off: every prompt, by default) travel as (file, offset, rows); the rest
    (copied rows: zero-copy off, or rows that fell back to several blocks) are written on a local
    thread. Each batch is split over the processes by bytes still to write (least loaded first). The driver holds every sample until its file
    is written, so the engine cannot reuse those rows meanwhile, and at most ``queue_size + 1``
    batches are in flight (bounded memory, as BackgroundWriter). No driver thread is involved
    in talking to the processes (see the comment above ``_FRAME``): results are taken in
    ``put()``, ``written`` and ``close()``. Same files, same bytes, same
    checksums.jsonl as BackgroundWriter.
    """

    def __init__(
        self,
        out: OutputDir,
        describe,
        queue_size: int = 2,
        processes: int | None = None,
        gpu_workers: int | None = None,
    ):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = writer_pool(processes, gpu_workers)
        if not self.pool.lock.acquire(timeout=60):
            raise OutputError("another pipeline in this process is using the writer processes")
        self.out, self.describe, self.limit = out, describe, max(1, queue_size) + 1
        self.error: BaseException | None = None
        self.in_processes = 0  # samples sent as (file, offset, rows) to a writer process
        self.on_threads = 0  # samples written on the local thread (rows not lent)
        self.wait_s = 0.0  # time put() spent waiting for a batch in flight to be written
        self.tail_s = 0.0  # time close() spent waiting for the last writes
        # time put() and close() spent waiting while a process had not started yet (its torch
        # import, ~1-3 s): not the disk's doing, so kept out of wait_s and tail_s
        self.start_wait_s = 0.0
        self._sums = ChecksumLog(out)
        self._times = StageTimes()
        self._cv = threading.Condition()  # the local threads report through it too
        self._pending: dict[int, InFlight] = {}  # index -> the sample handed over, until written
        self._batches: dict[int, int] = {}  # batch -> samples not yet written
        self._nbatch = 0
        self._local = ThreadPoolExecutor(max_workers=2, thread_name_prefix="speculators-compat-write")
        for w in self.pool.procs:  # a process not yet heard from says when it has started (a pong)
            if not w.answered:
                w.send("ping")

    # -------------------------------------------------------------- producer side
    def put(self, items: list[tuple[int, dict]], upto: int | None = None) -> None:
        """Queue one batch's samples (blocks while ``queue_size + 1`` batches are in flight)."""
        import numpy as np

        self._poll(0)
        while self.error is None and len(self._batches) >= self.limit:
            self._timed_poll("wait_s")
        self.check()
        if not items:
            return
        with self._cv:
            batch = self._nbatch
            self._nbatch += 1
            self._batches[batch] = len(items)
            for index, sample in items:
                self._pending[index] = InFlight(batch, sample)
        tasks: dict[int, list[SampleTask]] = {}
        procs = self.pool.procs
        for index, sample in items:
            blocks = [self.describe(h) for h in sample["hidden_states"]]
            scales = sample.get(SCALES_KEY)
            sblock = self.describe(scales) if scales is not None else None
            if all(b is not None for b in blocks) and (scales is None or sblock is not None):
                h0 = sample["hidden_states"][0]
                size = sum(h.numel() * h.element_size() for h in sample["hidden_states"])
                k = min(range(len(procs)), key=lambda i: procs[i].load)  # least bytes still to write
                procs[k].load += size
                with self._cv:
                    self._pending[index].proc, self._pending[index].size = procs[k], size
                tasks.setdefault(k, []).append(
                    SampleTask(
                        index,
                        np.ascontiguousarray(sample["input_ids"].numpy()),
                        np.ascontiguousarray(sample["loss_mask"].numpy()),
                        blocks,
                        int(h0.shape[-1]),
                        str(h0.dtype).replace("torch.", ""),
                        sblock,
                        sample.get("dequantize_dtype"),
                    )
                )
            else:
                self._local.submit(self._write_local, index, sample)
                self.on_threads += 1
        for k, samples in tasks.items():  # one message per process and batch
            procs[k].send(WriteTask(str(self.out.root), self.out.fmt, self._sums.checksum, samples))
            self.in_processes += len(samples)

    def _write_local(self, index: int, sample: dict) -> None:
        try:
            times = StageTimes()
            path = self.out.root / file_name(index, self.out.fmt)
            digest, nbytes = write_sample(path, sample, self.out.fmt, self._sums.checksum, durable=True, times=times)
            with self._cv:
                self._times.add(times)
            self._done(index, digest, nbytes, int(sample["input_ids"].numel()))
        except BaseException as e:
            self._fail(e)

    # -------------------------------------------------------------- results
    @property
    def written(self) -> int:
        self._poll(0)  # (results that arrived since the last look)
        return self._sums.written

    @property
    def bytes_written(self) -> int:
        self._poll(0)
        return self._sums.bytes

    def _done(self, index: int, digest: str, nbytes: int, tokens: int, mtime_ns: int | None = None) -> None:
        """Record a written file and free its sample's rows."""
        with self._cv:
            if index not in self._pending:  # not ours (cannot happen: the pool restarts after a failure)
                raise OutputError(f"writer process reported sample {index}, which this run did not send")
            self._sums.add(index, digest, nbytes, tokens, mtime_ns=mtime_ns)
            done = self._pending.pop(index)  # drops the sample: its rows may be reused
            if done.proc is not None:
                done.proc.load -= done.size
            self._batches[done.batch] -= 1
            if not self._batches[done.batch]:
                del self._batches[done.batch]
            self._cv.notify_all()

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, WriterProcessDied):
            # the pool is not reused even if this writer is never closed, nor while the dead
            # process, whose pipe already reads end-of-file, has not been reaped yet
            self.pool.broken = True
        with self._cv:
            if self.error is None:
                self.error = e
            self._cv.notify_all()

    def _timed_poll(self, counter: str) -> None:
        """One wait for results, its time added to ``counter`` (``wait_s`` or ``tail_s``), or to
        ``start_wait_s`` while a process has not started yet."""
        import time

        if not all(w.answered for w in self.pool.procs):
            counter = "start_wait_s"
        t = time.perf_counter()
        self._poll(self._wait_step())
        setattr(self, counter, getattr(self, counter) + time.perf_counter() - t)

    def _wait_step(self) -> float:
        """How long one wait for results may last: short while task bytes wait for room in a
        pipe, or local threads are writing (they report through the condition, not a pipe)."""
        with self._cv:  # (local threads pop what they wrote)
            local = any(f.proc is None for f in self._pending.values())
        if any(w.outbox for w in self.pool.procs) or local:
            return 0.005
        return 0.5

    def _poll(self, timeout: float) -> None:
        """Write what waits in the outboxes, take every result that has arrived (waiting up to
        ``timeout`` s for one), and turn a dead process into the run's error."""
        from multiprocessing.connection import wait

        procs = self.pool.procs
        for w in procs:
            w.flush()
        try:
            ready = wait([w.results for w in procs], timeout)
        except (OSError, ValueError) as e:  # the pool was torn down under us
            self._fail(e)
            return
        for conn in ready:
            w = next(w for w in procs if w.results is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._fail(_died(w.proc, w.proc.exitcode if not w.proc.is_alive() else "unknown (pipe closed)"))
                continue
            w.answered = True  # (a "pong" carries no results)
            try:
                with self._cv:
                    self._times.add(msg[2])
                for rec in msg[1]:
                    self._done(*rec)
                if msg[0] == "error":  # (its errno kept: a full disk is told apart by the run)
                    cause = OSError(msg[5], msg[4]) if msg[5] is not None else None
                    err = OutputError(f"writing sample {msg[3]} failed: {msg[4]}")
                    err.__cause__ = cause
                    self._fail(err)
            except BaseException as e:
                self._fail(e)
        if not ready and timeout:
            dead = self.pool.dead()
            if dead:
                self._fail(_died(dead[0], dead[0].exitcode))

    def close(self) -> None:
        """Wait for every queued sample (or the first failure), release the pool, re-raise."""
        try:
            while self.error is None and self._pending:
                self._timed_poll("tail_s")
            self._local.shutdown(wait=True)
            self._sums.close()
            if self.error is not None:  # tasks of this run may still be queued: start afresh next time
                shutdown_writer_pool(graceful=False)
            with self._cv:
                self._pending.clear()
        finally:
            self.pool.lock.release()
        self.check()


atexit.register(shutdown_writer_pool)  # let the processes finish and exit before the interpreter

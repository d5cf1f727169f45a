"""What the pipeline's writers share (``Writer``: the first failure, the checksum log, the counts,
where the time went) and the thread writer (``BackgroundWriter``). The process writer
(processes.py) and the shard writer (shards.py) build on the same base.

Every writer makes each file durable (fdatasync, on its own thread) before it renames it into
place and records it in checksums.jsonl: a file's write-back starts as soon as it is complete,
overlapping the engine's work and the other files', and a recorded file is one a resume may trust
after a crash or a power cut (its record says ``"durable": true``).
"""

from __future__ import annotations

import json
import os
import threading
import time

from ...errors import OutputError
from ...files.checksums import DEFAULT_CHECKSUM
from ...files.formats import write_sample
from ...files.registry import file_name
from ...files.stages import StageTimes
from ...host import usable_cpus
from ..output.outdir import OutputDir


class ChecksumLog:
    """``checksums.jsonl``: one line per finished file, appended as files complete (both writers).
    Not locked: callers serialise ``add``."""

    def __init__(self, out: OutputDir):
        self.fmt, self.checksum, self.root = out.fmt, out.checksum or DEFAULT_CHECKSUM, out.root
        self.f = open(out.records / "checksums.jsonl", "a", encoding="utf-8")  # (a rank: its own)
        self.written = 0
        self.bytes = 0  # of the files this run wrote
        self.record_s = 0.0  # time spent recording them

    def add(
        self,
        index: int,
        digest: str | None,
        nbytes: int,
        tokens: int,
        file: str | None = None,
        samples: int | None = None,
        mtime_ns: int | None = None,
    ) -> None:
        """``file``/``samples``: a shard's name and sample count (its ``index`` is its first sample).
        ``mtime_ns``: the file's modification time where its writer read it (else read here)."""
        t = time.perf_counter()
        name = file or file_name(index, self.fmt)
        rec = {"index": index, "file": name, "bytes": nbytes, "tokens": tokens}
        if mtime_ns is None:  # the file's write time: a resume checks that it has not changed since
            try:
                mtime_ns = os.stat(self.root / name).st_mtime_ns
            except OSError:
                pass
        if mtime_ns is not None:
            rec["mtime_ns"] = mtime_ns
        if samples is not None:
            rec["samples"] = samples
        if digest is not None:
            rec[self.checksum] = digest
        rec["durable"] = True  # (every writer syncs a file before it renames and records it)
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.written += 1
        self.bytes += nbytes
        self.record_s += time.perf_counter() - t

    def close(self) -> None:
        self.f.close()


def default_writer_threads() -> int:
    """Half the CPUs, 2..8 (1 on one CPU). Each thread streams torch.save through the file's
    checksum; a GPU host's generate() outruns a few of them (docs/benchmarks.md)."""
    cpus = usable_cpus()
    return min(8, max(min(2, cpus), cpus // 2))


class Writer:
    """What the pipeline's writers share: the first failure, which ``check()`` raises to the
    producer, and the counts of what this run wrote (from its checksum log)."""

    error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise OutputError(f"writing to {self.out.root} failed: {self.error}") from self.error

    @property
    def written(self) -> int:
        return self._sums.written

    @property
    def bytes_written(self) -> int:
        return self._sums.bytes

    def stage_times(self) -> StageTimes:
        """Where the writing time went (files/stages.py), of what was written so far."""
        out = StageTimes(record=self._sums.record_s)
        out.add(self._times)
        return out

    def finish(self, n_samples: int) -> None:
        """The run handed over all it will (``n_samples`` read). Only the shard writer needs to
        know; ``upto`` in ``put`` likewise (every index below it has been handed over)."""

    def _consume(self, handle) -> None:
        """A writer thread's loop: ``handle`` each message from ``self.q`` until None. The first
        failure (disk full, permissions) is kept for ``check()``; later messages are drained
        unhandled, so the producer never blocks on a queue nobody empties."""
        while True:
            msg = self.q.get()
            if msg is None:
                return
            if self.error is not None:
                continue
            try:
                handle(msg)
            except BaseException as e:
                self.error = e


class BackgroundWriter(Writer):
    """Writes (index, sample) items on a pool of threads. At most ``queue_size + 1`` batches are
    in flight (handed over and not all written): memory stays bounded, and ``put()`` waits for
    room. Files are written as they come, across batches (no thread waits for a batch's slowest
    file)."""

    def __init__(self, out: OutputDir, queue_size: int = 2, threads: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        n = threads if threads is not None else default_writer_threads()
        if n < 1:
            raise ValueError(f"writer threads must be >= 1, not {n}")
        self.out, self.limit = out, max(1, queue_size) + 1
        self.error: BaseException | None = None
        self.wait_s = 0.0  # time put() spent waiting for room
        self.tail_s = 0.0  # time close() spent waiting for the last writes
        self.start_wait_s = 0.0  # (threads start at once; see ProcessWriter)
        self._sums = ChecksumLog(out)
        self._times = StageTimes()
        self._cv = threading.Condition()  # guards the counts below, the log and _times
        self._batches: dict[int, int] = {}  # batch -> its files not yet written
        self._nbatch = 0
        # (hashing and file writes release the GIL: the threads write in parallel)
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="speculators-compat-write")

    def put(self, items: list[tuple[int, dict]], upto: int | None = None) -> None:
        """Hand over one batch's samples (blocks while ``queue_size + 1`` batches are in flight);
        re-raises a writer failure."""
        t = time.perf_counter()
        with self._cv:
            while self.error is None and len(self._batches) >= self.limit:
                self._cv.wait()
            self.wait_s += time.perf_counter() - t
            self.check()
            if not items:
                return
            batch, self._nbatch = self._nbatch, self._nbatch + 1
            self._batches[batch] = len(items)
        for item in items:
            self._pool.submit(self._write_one, batch, item)

    def _write_one(self, batch: int, item: tuple[int, dict]) -> None:
        index, sample = item
        try:
            if self.error is None:  # (after a failure the rest is dropped, unwritten)
                times = StageTimes()
                path = self.out.root / file_name(index, self.out.fmt)
                digest, nbytes = write_sample(
                    path, sample, self.out.fmt, self._sums.checksum, durable=True, times=times
                )
                with self._cv:
                    self._sums.add(index, digest, nbytes, int(sample["input_ids"].numel()))
                    self._times.add(times)
        except BaseException as e:  # kept for check(): the producer's next put() raises it
            with self._cv:
                self.error = self.error or e
        finally:
            with self._cv:
                self._batches[batch] -= 1
                if not self._batches[batch]:
                    del self._batches[batch]
                self._cv.notify_all()

    def close(self) -> None:
        t = time.perf_counter()
        with self._cv:
            while self._batches:
                self._cv.wait()
        self.tail_s = time.perf_counter() - t
        self._pool.shutdown(wait=True)
        self._sums.close()
        self.check()

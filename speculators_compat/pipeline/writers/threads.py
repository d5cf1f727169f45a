"""What the pipeline's writers share (``Writer``: the first failure, the checksum log, the counts)
and the thread writer (``BackgroundWriter``). The process writer (procwriter.py) and the shard
writer (shards.py) build on the same base.
"""

from __future__ import annotations

import json
import os
import queue
import threading

from ...errors import OutputError
from ...files.checksums import DEFAULT_CHECKSUM
from ...files.formats import file_name, write_sample
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

    def add(
        self,
        index: int,
        digest: str | None,
        nbytes: int,
        tokens: int,
        file: str | None = None,
        samples: int | None = None,
    ) -> None:
        """``file``/``samples``: a shard's name and sample count (its ``index`` is its first sample)."""
        name = file or file_name(index, self.fmt)
        rec = {"index": index, "file": name, "bytes": nbytes, "tokens": tokens}
        try:  # the file's write time: a resume checks that the file has not changed since (OutputDir)
            rec["mtime_ns"] = os.stat(self.root / name).st_mtime_ns
        except OSError:
            pass
        if samples is not None:
            rec["samples"] = samples
        if digest is not None:
            rec[self.checksum] = digest
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.written += 1
        self.bytes += nbytes

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
    """Writes (index, sample) items on a thread; ``queue_size`` bounds what waits in memory."""

    def __init__(self, out: OutputDir, queue_size: int = 2, threads: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.out = out
        self.q: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.error: BaseException | None = None
        self.wait_s = 0.0  # time put() spent waiting for room in the queue
        self.tail_s = 0.0  # time close() spent waiting for the last writes
        self.start_wait_s = 0.0  # (threads start at once; see ProcessWriter)
        self._sums = ChecksumLog(out)
        self._lock = threading.Lock()
        # Files of one batch are written in parallel (hashing and file writes release the GIL);
        # the next batch waits, so memory stays bounded by queue_size + 1 batches.
        n = threads if threads is not None else default_writer_threads()
        if n < 1:
            raise ValueError(f"writer threads must be >= 1, not {n}")
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="speculators-compat-write") if n > 1 else None
        self._t = threading.Thread(target=self._loop, name="speculators-compat-writer", daemon=True)
        self._t.start()

    def put(self, items: list[tuple[int, dict]], upto: int | None = None) -> None:
        """Queue one batch's samples (blocks while the queue is full); re-raises a writer failure."""
        import time

        self.check()
        t = time.perf_counter()
        self.q.put(items)
        self.wait_s += time.perf_counter() - t

    def _loop(self) -> None:
        self._consume(self._write_batch)

    def _write_batch(self, items: list[tuple[int, dict]]) -> None:
        if self._pool is None:
            for item in items:
                self._write_one(item)
        else:
            for f in [self._pool.submit(self._write_one, item) for item in items]:
                f.result()  # re-raises the first failure

    def _write_one(self, item: tuple[int, dict]) -> None:
        index, sample = item
        digest, nbytes = write_sample(
            self.out.root / file_name(index, self.out.fmt), sample, self.out.fmt, self._sums.checksum
        )
        with self._lock:
            self._sums.add(index, digest, nbytes, int(sample["input_ids"].numel()))

    def close(self) -> None:
        import time

        t = time.perf_counter()
        self.q.put(None)
        self._t.join()
        self.tail_s = time.perf_counter() - t
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._sums.close()
        self.check()

"""Sharded safetensors output: ``extract --format safetensors --shard-size N``.

Sample ``i`` goes to shard ``k = i // N``, the file ``shard_{k}.safetensors``, which holds the
samples of ``[k*N, (k+1)*N)`` that the run produced (an over-long sample skipped with
``--on-overlength skip`` is absent). Each sample's tensors are named by its dataset index:
``{i}.input_ids``, ``{i}.loss_mask`` and ``{i}.hidden_states.{j}`` (j: position in the run's layer
ids). The file's safetensors metadata key ``speculators_compat`` holds JSON with the shard's range
(``first``, ``end``) and the indices it holds, so ``load_shard`` (or any safetensors reader) finds
them without a manifest.

Why: one file per sample costs a fixed time of serialising, hashing, creating and renaming,
whatever its size. For small hidden states (small drafts, short prompts, millions of samples) that
fixed cost is most of the writing, and a million samples is a million files. speculators 0.3.0's
trainer reads only ``data_{i}.pt``; shards are for readers of our own (``load_shard``) or others.

Resume works by shard: a shard file is complete or absent (written to a temp name, then renamed).
A shard is done when it covers its whole range, or, for the dataset's last shard, when it reaches
the end of the input (``end >= total``). A last shard written by a shorter run (``--max-samples``)
is computed again and rewritten, so a resumed dataset is byte-identical to an uninterrupted one.

Complete shards are written on a pool of threads (``--writer-threads``, default half the CPUs,
2..8), far slower than the writer processes that write ``data_{i}.pt`` (docs/benchmarks.md):
the threads share the GIL with the driver. States of several MB a sample gain nothing from sharing a file; shards are for small ones.

The shard writer holds the shard being filled and at most one shard per writer thread being
written (each up to N samples, copied out of the engine's lent rows so that the engine can reuse
them) on top of the write queue: host memory grows with N and the threads, not with the dataset.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

from ...files.checksums import new_digest
from ...files.formats import SHARD_TAG, distinct_states, read_shard_range, shard_name, write_parts
from ...files.registry import format_names, get_format
from ...files.stages import Clock, StageTimes
from .threads import ChecksumLog, Writer, default_writer_threads

logger = logging.getLogger("speculators_compat.pipeline")


def check_shard_size(shard_size: Any, fmt: str, writer: str) -> int:
    """The shard size, or a ValueError that names what is wrong with it."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"--shard-size must be an integer >= 1 (samples per file), not {shard_size!r}")
    if shard_size > 1 and not get_format(fmt).shardable:
        shardable = " or ".join(n for n in format_names() if get_format(n).shardable)
        raise ValueError(
            f"--shard-size {shard_size} needs --format {shardable}: the {fmt} format is one file a sample "
            "(speculators' trainers read it so)"
        )
    if shard_size > 1 and writer == "process":
        raise ValueError(
            "--shard-size > 1 writes with threads: --writer process is not supported with it "
            "(use --writer auto or thread)"
        )
    return shard_size


def shard_bytes(samples: list[tuple[int, dict]], first: int, end: int) -> bytes:
    """One shard's file contents (safetensors), from (index, sample) pairs in index order."""
    from safetensors.torch import save

    tensors = {}
    for i, s in samples:
        tensors[f"{i}.input_ids"] = s["input_ids"].contiguous()
        tensors[f"{i}.loss_mask"] = s["loss_mask"].contiguous()
        tensors.update(distinct_states(f"{i}.hidden_states.{{}}", s["hidden_states"]))
    # one metadata key: safetensors writes a metadata map's keys in no fixed order (seen with
    # 0.8.0: 12 orders in 20 saves of one map), and a resumed shard must be byte-identical
    info = {"format": SHARD_TAG, "first": first, "end": end, "indices": [i for i, _ in samples]}
    return save(tensors, metadata={"speculators_compat": json.dumps(info, sort_keys=True)})


def load_shard(path: str | Path) -> list[dict[str, Any]]:
    """The samples of one shard, in index order: dicts with ``index``, ``input_ids``,
    ``hidden_states`` (a list, one tensor per layer id) and ``loss_mask``, as in ``data_{i}.pt``."""
    from safetensors.torch import load_file

    path = Path(path)
    _, _, indices = read_shard_range(path)
    t = load_file(str(path))
    out = []
    for i in indices:
        n = sum(1 for k in t if k.startswith(f"{i}.hidden_states."))
        out.append(
            {
                "index": i,
                "input_ids": t[f"{i}.input_ids"],
                "loss_mask": t[f"{i}.loss_mask"],
                "hidden_states": [t[f"{i}.hidden_states.{j}"] for j in range(n)],
            }
        )
    return out


class ShardWriter(Writer):
    """Like BackgroundWriter (put / check / close, the same counters), but groups samples into
    shards. ``put(items, upto)`` says that every index below ``upto`` has been handed over: the
    shards below it are written then. ``finish(n)`` lets the last shard, which ends at ``n``, be
    written at ``close()``; after an error nothing incomplete is written (the run resumes it)."""

    def __init__(self, out, queue_size: int = 2, threads: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        n = threads if threads is not None else default_writer_threads()
        if n < 1:
            raise ValueError(f"writer threads must be >= 1, not {n}")
        # complete shards are written on n threads at once (building a file, hashing and writing
        # it largely release the GIL); at most n are in flight, which bounds the memory they hold
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="speculators-compat-shard")
        self._inflight: list = []
        self._max_inflight = n
        self._lock = threading.Lock()
        self.out, self.size = out, out.shard_size
        self.q: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.error: BaseException | None = None
        self.wait_s = self.tail_s = self.start_wait_s = 0.0
        self._sums = ChecksumLog(out)
        self._times = StageTimes()
        self._pending: dict[int, list[tuple[int, dict]]] = {}  # shard -> its samples so far (owned copies)
        self._end: int | None = None
        self._t = threading.Thread(target=self._loop, name="speculators-compat-shards", daemon=True)
        self._t.start()

    def put(self, items: list[tuple[int, dict]], upto: int | None = None) -> None:
        self.check()
        t = time.perf_counter()
        self.q.put((items, upto))
        self.wait_s += time.perf_counter() - t

    def finish(self, n_samples: int) -> None:
        """The run read ``n_samples`` samples and handed over all it will: the last shard may go."""
        self._end = n_samples

    def _loop(self) -> None:
        self._consume(self._take)

    def _take(self, msg: tuple[list[tuple[int, dict]], int | None]) -> None:
        items, upto = msg
        for i, s in items:  # owned copies: the engine's lent rows go back at once
            own = {
                "input_ids": s["input_ids"].clone(),
                "loss_mask": s["loss_mask"].clone(),
                "hidden_states": [h.clone() for h in s["hidden_states"]],
            }
            self._pending.setdefault(i // self.size, []).append((i, own))
        if upto is not None:
            self._flush(upto, final=False)

    def _flush(self, upto: int, final: bool) -> None:
        for k in sorted(self._pending):
            first = k * self.size
            end = min(first + self.size, upto)
            if not final and end < first + self.size:
                break  # this shard still waits for samples
            samples = sorted(self._pending.pop(k), key=lambda x: x[0])
            self._wait_for_room()
            self._inflight.append(self._pool.submit(self._write_shard, k, samples, first, end))

    def _wait_for_room(self, all_: bool = False) -> None:
        """Collect finished shard writes (re-raising the first failure); wait while the pool is full
        (or, with ``all_``, until every write has finished)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        while self._inflight:
            for f in [f for f in self._inflight if f.done()]:
                self._inflight.remove(f)
                f.result()
            if not all_ and len(self._inflight) < self._max_inflight:
                return
            if self._inflight:
                wait(self._inflight, return_when=FIRST_COMPLETED)

    def _write_shard(self, k: int, samples: list[tuple[int, dict]], first: int, end: int) -> None:
        try:
            self._write_shard_now(k, samples, first, end)
        except BaseException as e:  # seen by the producer's next put(), not only by the next flush
            self.error = self.error or e
            raise

    def _write_shard_now(self, k: int, samples: list[tuple[int, dict]], first: int, end: int) -> None:
        times = StageTimes(files=1)
        clock = Clock(times)
        data = shard_bytes(samples, first, end)
        clock.lap("encode")
        digest = new_digest(self._sums.checksum, data).hexdigest()
        clock.lap("checksum")
        times.bytes = write_parts(self.out.root / shard_name(k), [data], durable=True, clock=clock)
        with self._lock:
            self._times.add(times)
            self._sums.add(
                first,
                digest,
                len(data),
                sum(int(s["input_ids"].numel()) for _, s in samples),
                file=shard_name(k),
                samples=len(samples),
            )

    def close(self) -> None:
        t = time.perf_counter()
        self.q.put(None)
        self._t.join()
        try:
            if self.error is None and self._end is not None and self._pending:
                self._flush(self._end, final=True)
        except BaseException as e:
            self.error = e
        while True:  # every shard already handed to the pool is finished, even after an error
            try:
                self._wait_for_room(all_=True)
                break
            except BaseException as e:
                self.error = self.error or e
        self._pool.shutdown(wait=True)
        self.tail_s = time.perf_counter() - t
        self._sums.close()
        self.check()

"""``extract --ray [ADDRESS]``: the ranks of one sharded run as Ray actors on a cluster.

Each shard is an actor holding one engine (``num_gpus`` = the tensor-parallel size, so Ray gives
it a whole TP group and sets its CUDA_VISIBLE_DEVICES; on a CPU cluster ``num_cpus`` = the TP
size), running ``run_extract`` for its rank into the shared output directory (ranks.py). The
actors report their counts to a small progress actor; this process shows one bar and logs each
shard's progress.

A shard whose actor dies (its process killed, its node lost) or whose engine died under it
(WorkerDiedError, StallError) is started again in a new actor, up to ``ATTEMPTS`` times in all:
resume makes the retry exact, and cheap (only its missing files are computed). A shard that
raised any other error (bad input, a failed self-check, an unusable output) would fail again: the
run stops at once, naming it. Either way the other shards are stopped and every file written stays
complete; the same command resumes.

``ray`` is an optional dependency (``pip install "speculators-compat[ray]"``), imported only here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from ...errors import ShardFailedError
from ..options import ExtractOptions

logger = logging.getLogger("speculators_compat.pipeline")

ATTEMPTS = 3  # per shard: the first run and two retries
REPORT_EVERY_S = 30.0  # per-shard progress lines in the log


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            'extract --ray needs Ray, which is not installed: pip install "speculators-compat[ray]"'
        ) from None
    return ray


class _Board:
    """The shards' counts: (total, done) per rank (a Ray actor)."""

    def __init__(self):
        self.counts: dict[int, list[int]] = {}

    def total(self, rank: int, n: int) -> None:
        self.counts[rank] = [n, 0]

    def update(self, rank: int, n: int) -> None:
        self.counts.setdefault(rank, [0, 0])[1] += n

    def snapshot(self) -> dict[int, list[int]]:
        return self.counts


class _BoardBar:
    """run_extract's progress bar in a shard: its counts go to the board."""

    def __init__(self, board, rank: int, total: int):
        self.board, self.rank = board, rank
        board.total.remote(rank, total)

    def update(self, n: int = 1) -> None:
        if n:
            self.board.update.remote(self.rank, n)

    def set_postfix_str(self, *a, **k) -> None: ...

    def close(self) -> None: ...


class _Shard:
    """One rank's engine (a Ray actor; its method runs in the actor's main thread)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, rank: int, world_size: int, job: tuple, board) -> dict:
        """``job``: (model, input, output, ExtractOptions)."""
        import dataclasses

        import speculators_compat  # noqa: F401  (the patches, in this worker process too)

        from ...engine.shm import sweep_orphan_shm
        from ..extract import run_extract

        sweep_orphan_shm()  # (an earlier attempt's engine, killed on this host, left its shared memory)
        model, input_path, output, opts = job
        opts = dataclasses.replace(opts, progress=lambda total: _BoardBar(board, rank, total))
        return run_extract(model, input_path, output, opts, rank=rank, world_size=world_size)


def _retryable(err: BaseException, ray) -> bool:
    """An actor that died, or an engine that died under it: worth a new actor."""
    from ...errors import StallError, WorkerDiedError

    if isinstance(err, ray.exceptions.RayActorError):
        return True
    cause = getattr(err, "cause", None)
    return isinstance(cause, (WorkerDiedError, StallError))


def run_on_ray(
    model: str,
    input_path: str,
    output: str,
    options: ExtractOptions | None = None,
    *,
    shards: int | None = None,
    address: str | None = None,
    **kw,
) -> dict[str, Any]:
    """Run the dataset as ``shards`` ranks on the Ray cluster at ``address`` (None: the one this
    process is connected to, else a local instance; "auto": the running cluster); ``shards``
    None: one per TP group of the cluster's GPUs (one on a cluster without GPUs). Returns one
    summary (as run_data_parallel's) with ``retries``: the shards started again. ``options``: as
    for run_extract (or its fields as keywords)."""
    from ...engine.shm import sweep_orphan_shm

    opts = ExtractOptions.given(options, kw)
    ray = _import_ray()
    own = not ray.is_initialized()
    if own:
        ray.init(address=address, log_to_driver=True)
    try:
        return _run(ray, model, input_path, output, shards, opts)
    except ray.exceptions.RayError as e:  # (the cluster itself: a node lost, the progress actor with it)
        raise ShardFailedError(
            f"the Ray cluster failed under the run ({_reason(e)}). Every file written is complete: run "
            "the same command again to resume"
        ) from None
    finally:
        if own:
            ray.shutdown()
        sweep_orphan_shm()  # (what the shards' engines killed on this host left in /dev/shm)


def _run(ray, model, input_path, output, shards, opts: ExtractOptions) -> dict[str, Any]:
    from ..progress import progress_bar
    from .parallel import merge_summaries

    tp = opts.devices_per_engine  # (tensor x pipeline parallel)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if shards is None:
        shards = max(1, gpus // tp) if gpus else 1
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"the number of shards must be an integer >= 1, not {shards!r}")
    need = {"num_gpus": tp, "num_cpus": 1} if gpus else {"num_gpus": 0, "num_cpus": tp}
    logger.info("Ray: %d shard(s), each an actor with %s", shards, need)
    board = ray.remote(_Board).options(num_cpus=0).remote()
    Shard = ray.remote(_Shard)
    job = (model, input_path, output, dataclasses.replace(opts, progress=False))  # (what an actor can take)

    def start(rank: int):
        actor = Shard.options(**need, name=f"speculators-compat-shard-{rank}-of-{shards}").remote()
        return actor, actor.run.remote(rank, shards, job, board)

    running = {r: start(r) for r in range(shards)}  # rank -> (actor, its run's ref)
    attempts = dict.fromkeys(range(shards), 1)
    summaries: dict[int, dict] = {}
    bar, t0, last_report = None, time.time(), time.time()
    try:
        while running:
            ready, _ = ray.wait([ref for _, ref in running.values()], num_returns=1, timeout=1.0)
            for ref in ready:
                rank = next(r for r, (_, x) in running.items() if x == ref)
                actor, _ = running.pop(rank)
                try:
                    summaries[rank] = ray.get(ref)
                except Exception as e:
                    if not _retryable(e, ray) or attempts[rank] >= ATTEMPTS:
                        raise ShardFailedError(
                            f"Ray shard {rank} of {shards} failed (attempt {attempts[rank]} of {ATTEMPTS}): "
                            f"{_reason(e)}. The other shards were stopped; every file written is complete: "
                            "run the same command again to resume",
                            rank=rank,
                        ) from None
                    attempts[rank] += 1
                    logger.warning(
                        "Ray shard %d of %d: %s; starting it again (attempt %d of %d): it resumes from its files",
                        rank,
                        shards,
                        _reason(e),
                        attempts[rank],
                        ATTEMPTS,
                    )
                    ray.kill(actor)
                    running[rank] = start(rank)
                    continue
                ray.kill(actor)
            counts = ray.get(board.snapshot.remote())
            if bar is None and len(counts) == shards:
                bar = progress_bar(sum(t for t, _ in counts.values()), opts.progress)
            if bar is not None:
                bar.update(sum(n for _, n in counts.values()) - bar.n if hasattr(bar, "n") else 0)
            if time.time() - last_report >= REPORT_EVERY_S:
                last_report = time.time()
                logger.info(
                    "Ray shards: %s",
                    "; ".join(f"{r}: {n}/{t}" for r, (t, n) in sorted(counts.items())),
                )
    except BaseException:
        for actor, _ in running.values():
            ray.kill(actor)
        raise
    finally:
        if bar is not None:
            bar.close()
        ray.kill(board)
    out = merge_summaries([summaries[r] for r in range(shards)], output, time.time() - t0, opts.fmt)
    out["retries"] = {r: n - 1 for r, n in attempts.items() if n > 1}
    return out


def _reason(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"

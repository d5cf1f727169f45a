"""``extract --data-parallel-size D``: D engines on one host, as D ranks of one sharded run.

Engine d runs in a process of its own (spawned: a fresh interpreter, so it sets its devices before
torch starts) on its own GPUs (``CUDA_VISIBLE_DEVICES``: devices ``[d*T, (d+1)*T)`` of the visible
ones) or, on a CPU host, its own cores (``VLLM_CPU_OMP_THREADS_BIND`` and the process's affinity:
the usable CPUs split evenly). Each is rank ``node*D + d`` of ``nodes*D`` (ranks.py), so D engines
on each of N hosts (``--world-size N --rank node``) make one dataset.

This process reads nothing and computes nothing: it starts the engines, shows one progress bar
and prints one summary for all of them. When an engine fails or dies, the others are stopped (as
by Ctrl-C: their files stay complete) and the run ends with a ShardFailedError naming the engine;
the same command then resumes every part.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import time
from typing import Any

from ...errors import ShardFailedError
from ..options import ExtractOptions
from ..output.layout import Layout
from ..ranks import cpu_groups, device_groups, forget_launcher_env, resolve_part, visible_devices

logger = logging.getLogger("speculators_compat.pipeline")

#: seconds the other engines get to shut down cleanly after one failed, before they are killed
STOP_GRACE_S = 120.0


def placements(dp: int, tp: int, devices: list[list[str]] | None = None) -> list[tuple[dict[str, str], list[int]]]:
    """(environment, CPUs) for each of ``dp`` engines (module docstring): GPUs by
    CUDA_VISIBLE_DEVICES, and on every host an even share of the usable CPUs as the process's
    affinity (its workers' and file writers' too, whose default counts follow it). ``devices``:
    the GPU ids per engine instead of the even split (e.g. two engines sharing one GPU, each with
    part of its memory: ``[["0"], ["0"]]``)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = len(cpus) // dp
    if share < 1:
        raise ValueError(f"{dp} engines need at least {dp} CPUs; {len(cpus)} are usable")
    cpu_sets = [cpus[d * share : (d + 1) * share] for d in range(dp)]
    if devices is not None:
        if len(devices) != dp:
            raise ValueError(f"devices lists {len(devices)} groups for {dp} engines")
        return [({"CUDA_VISIBLE_DEVICES": ",".join(g)}, c) for g, c in zip(devices, cpu_sets)]
    visible = visible_devices()
    if visible:
        return [({"CUDA_VISIBLE_DEVICES": ",".join(g)}, c) for g, c in zip(device_groups(visible, dp, tp), cpu_sets)]
    return [({"VLLM_CPU_OMP_THREADS_BIND": b}, c) for b, c in zip(cpu_groups(cpus, dp, tp), cpu_sets)]


class _QueueBar:
    """A progress bar stand-in in an engine process: sends its counts to the driver's one bar."""

    def __init__(self, q, d: int, total: int):
        self.q, self.d = q, d
        q.put(("total", d, total))

    def update(self, n: int = 1) -> None:
        if n:
            self.q.put(("update", self.d, n))

    def set_postfix_str(self, *a, **k) -> None: ...

    def close(self) -> None: ...


def _stop_with_parent() -> None:
    """Have this engine process sent SIGTERM when the command that started it dies, however it
    dies (kill -9 included): SIGTERM shuts the engine down as Ctrl-C does (its files complete, its
    workers and arena gone), where an orphan would run on to the end, holding its GPUs. Linux's
    PR_SET_PDEATHSIG; a parent already gone before it was set is seen by its pid."""
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError) as e:  # (not Linux: the engine outlives a killed command there)
        logger.warning("cannot tie this engine's life to its command's (%s)", e)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _engine_main(d: int, rank: int, world: int, env: dict[str, str], cpus: list[int], job: tuple, q) -> None:
    """One data-parallel engine (a spawned process): its devices, then run_extract for its rank.
    ``job``: (model, input, output, ExtractOptions)."""
    _stop_with_parent()
    os.environ.update(env)
    if hasattr(os, "sched_setaffinity"):  # (before vLLM starts its workers: they inherit it)
        os.sched_setaffinity(0, set(cpus))
    from ...signals import handle_termination

    handle_termination()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [engine {d}] %(name)s: %(message)s")
    model, input_path, output, opts = job
    try:
        from ..extract import run_extract

        opts = dataclasses.replace(opts, progress=lambda total: _QueueBar(q, d, total))
        summary = run_extract(model, input_path, output, opts, rank=rank, world_size=world)
    except BaseException as e:
        q.put(("error", d, f"{type(e).__name__}: {e}"))
        q.close()
        q.join_thread()
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 2)
    q.put(("done", d, summary))


def run_data_parallel(
    model: str,
    input_path: str,
    output: str,
    options: ExtractOptions | None = None,
    *,
    data_parallel_size: int,
    rank: int | None = None,
    world_size: int | None = None,
    devices: list[list[str]] | None = None,
    **kw,
) -> dict[str, Any]:
    """Run ``data_parallel_size`` engines as ranks of one run (module docstring) with ``options``
    (or its fields as keywords, as for run_extract); ``rank`` / ``world_size``: this host among
    several. Returns one summary for the run: the engines' counts added up, their number
    (``engines``) and each one's own figures (``per_engine``)."""
    import multiprocessing as mp

    opts = ExtractOptions.given(options, kw)
    dp = data_parallel_size
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"--data-parallel-size must be an integer >= 1, not {dp!r}")
    node = resolve_part(rank, world_size)
    if node.source.endswith("(torchrun)"):
        forget_launcher_env()
    places = placements(dp, opts.devices_per_engine, devices)
    parts = [node.sub(d, dp) for d in range(dp)]
    job = (model, input_path, output, dataclasses.replace(opts, progress=False))  # (what a process can take)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time()
    procs = [_start_engine(ctx, d, part, place, job, q) for d, (part, place) in enumerate(zip(parts, places))]
    summaries, failure = _follow(procs, q, dp, opts.progress)
    if failure is not None:
        _stop(procs)
        d, why = failure
        raise ShardFailedError(
            f"data-parallel engine {d} of {dp} ({parts[d].label}; {', '.join(f'{k}={v}' for k, v in places[d][0].items())}) "
            f"failed: {why}. The other engines were stopped; every file written is complete: run the "
            "same command again to resume",
            rank=parts[d].rank,
        )
    for p in procs:
        p.join()
    return merge_summaries([summaries[d] for d in range(dp)], output, time.time() - t0, opts.fmt)


def _start_engine(ctx, d: int, part, place, job: tuple, q):
    env, cpus = place
    p = ctx.Process(
        target=_engine_main,
        args=(d, part.rank, part.world_size, env, cpus, job, q),
        name=f"speculators-compat-engine-{d}",
    )
    p.start()
    where = ", ".join(f"{k}={v}" for k, v in env.items())
    logger.info("engine %d (pid %d): %s, %s, CPUs %s", d, p.pid, part.label, where, _ranges(cpus))
    return p


def _follow(procs, q, dp: int, progress) -> tuple[dict[int, dict], tuple[int, str] | None]:
    """Show the engines' progress on one bar until each is done, or one failed or died:
    (their summaries, (the failed engine, why) or None)."""
    from ..progress import progress_bar

    bar, totals, summaries, early = None, {}, {}, 0
    failure: tuple[int, str] | None = None
    gone: dict[int, float] = {}  # engine -> when its process was first seen dead
    try:
        while len(summaries) < dp and failure is None:
            try:
                kind, d, payload = q.get(timeout=0.5)
            except queue.Empty:
                kind = None
            if kind == "total":
                totals[d] = payload
                if len(totals) == dp:
                    bar = progress_bar(sum(totals.values()), progress)
                    bar.update(early)
            elif kind == "update":
                if bar is None:
                    early += payload
                else:
                    bar.update(payload)
            elif kind == "done":
                summaries[d] = payload
            elif kind == "error":
                failure = (d, payload)
            failure = failure or _dead(procs, summaries, gone)
    except BaseException:  # Ctrl-C / SIGTERM here: every engine gets it too (or is sent it)
        _stop(procs)
        raise
    finally:
        if bar is not None:
            bar.close()
    return summaries, failure


def _dead(procs, summaries: dict, gone: dict[int, float]) -> tuple[int, str] | None:
    """The first engine whose process exited without a summary (its exit code named), once its
    last messages have had 2 s to arrive; else None."""
    now = time.time()
    for d, p in enumerate(procs):
        if p.is_alive() or d in summaries:
            continue
        if now - gone.setdefault(d, now) < 2.0:
            continue
        code = p.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return d, f"its process (pid {p.pid}) died ({how})"
    return None


def _stop(procs) -> None:
    """SIGTERM to every engine still running (each shuts down as on Ctrl-C), then wait; killed
    after STOP_GRACE_S."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.time() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            logger.warning("engine process %d did not stop within %.0f s: killing it", p.pid, STOP_GRACE_S)
            p.kill()
            p.join()


def _ranges(cpus: list[int]) -> str:
    return (
        f"{cpus[0]}-{cpus[-1]}"
        if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1))
        else ",".join(map(str, cpus))
    )


def merge_summaries(summaries: list[dict], output: str, wall_s: float, fmt: str = "pt") -> dict[str, Any]:
    """One summary for the engines of a run: counts added up; throughput over the longest
    engine's compute phase (they run at once); ``engines``: how many; ``per_engine``: each one's
    own figures."""

    def total(key):
        return sum(s.get(key) or 0 for s in summaries)

    compute_s = max((s["seconds"] - s["engine_start_s"] for s in summaries), default=0.0)
    checks = [s["self_check"] for s in summaries if s.get("self_check")]
    out = {
        "output": str(output),
        "samples": max((s["samples"] for s in summaries), default=0),
        "files": total("files"),
        "new_files": total("new_files"),
        "already_done": total("already_done"),
        "computed": total("computed"),
        "tokens_computed": total("tokens_computed"),
        "bytes": total("bytes"),
        "seconds": round(wall_s, 2),
        "engine_start_s": max((s["engine_start_s"] for s in summaries), default=0.0),
        "tokens_per_s": round(total("tokens_computed") / max(compute_s, 1e-9), 1),
        "truncated": max((s["truncated"] for s in summaries), default=0),
        "skipped_overlength": max((s["skipped_overlength"] for s in summaries), default=0),
        "engines": len(summaries),
        "self_check": {
            **{k: sum(c.get(k, 0) for c in checks) for k in ("checked", "failed", "near_ties", "values_checked")},
            **{k: max(c.get(k, 0.0) for c in checks) for k in ("max_gap", "max_logprob_diff")},
        }
        if checks
        else None,
        "dataset_complete": Layout.of(output, fmt).manifest.exists(),
        "per_engine": [
            {k: s.get(k) for k in ("rank", "world_size", "computed", "tokens_computed", "seconds", "tokens_per_s")}
            for s in summaries
        ],
    }
    return out

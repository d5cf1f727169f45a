"""``speculators-compat extract``: dataset -> fixed batches -> generator -> background writer.

Batches are fixed partitions of the sample indices (``[k*B, (k+1)*B)``), whatever was done before,
so a resumed run feeds the engine exactly the batches an uninterrupted run would: a batch that is
partly on disk is recomputed whole and only its missing samples are written. That is what makes
a resumed dataset byte-identical to an uninterrupted one (the engine is deterministic for a given
batch; the scheduler splits it the same way).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from itertools import islice
from typing import Any

from .. import versions
from ..errors import TokenIdError
from .checksums import check_checksum
from .dataset import DatasetError, Sample, check_unchanged, open_dataset, scan_input
from .outdir import OutputDir
from .preflight import check_free_space, dtype_name, warn_overlength
from .procwriter import ProcessWriter
from .progress import progress_bar
from .ranks import forget_launcher_env, partition_unit, pick_local_devices, resolve_part
from .reading import _batches, _Prefetch
from .shards import ShardWriter, check_shard_size
from .writers import BackgroundWriter

WRITER_MODES = ("auto", "thread", "process")


def _gpu_host() -> bool:
    from ..host import cuda_device_count

    return cuda_device_count() > 0


def choose_writer(mode: str, generator) -> str:
    """``auto``: processes on a GPU host when the engine lends its rows (the driver's spinning
    thread then starves writer threads of the GIL), threads elsewhere (a CPU engine needs the
    cores, and files are small against its compute)."""
    if mode not in WRITER_MODES:
        raise ValueError(f"writer must be one of {WRITER_MODES}, not {mode!r}")
    if mode != "auto":
        return mode
    from ..host import cuda_device_count

    engine = getattr(generator, "engine", None)
    return "process" if getattr(engine, "lends_rows", False) and cuda_device_count() > 0 else "thread"


logger = logging.getLogger("speculators_compat.pipeline")


def run_extract(
    model: str,
    input_path: str,
    output: str,
    *,
    layer_ids=None,
    batch_size: int = 8,
    max_samples: int | None = None,
    fmt: str = "pt",
    on_overlength: str = "truncate",
    queue_size: int = 2,
    progress: bool = True,
    generator=None,
    writer_threads: int | None = None,
    layer_id_convention: str | None = None,
    writer: str = "auto",
    checksum: str | None = None,
    shard_size: int = 1,
    verify_existing: bool = False,
    self_check: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    **gen_kwargs,
) -> dict[str, Any]:
    """Extract ``input_path`` into ``output`` (module docstring). Everything that can be checked
    without an engine is checked before one starts: the output directory (held with a lock; another
    run's output refused), the model's files, and the whole input (every sample validated, the
    over-long ones named). ``verify_existing``: checksum every file a resume keeps, not only the
    ones the interrupted run wrote last. ``self_check`` (on): every request's sampled token set
    against its captured state (engine/selfcheck.py), on the given generator too, for this run.
    ``rank``/``world_size``: compute only that part of the dataset (ranks.py; None: from a
    launcher's environment, else all of it). ``progress``: a bool (a tqdm bar or none), or a
    callable ``(total) -> bar`` with tqdm's ``update``/``set_postfix_str``/``close``."""
    model, input_path, output = (os.fspath(p) if isinstance(p, os.PathLike) else p for p in (model, input_path, output))
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, not {batch_size}")
    if max_samples is not None and (
        isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 0
    ):
        raise ValueError(f"--max-samples must be an integer >= 0, not {max_samples!r}")
    if writer not in WRITER_MODES:
        raise ValueError(f"writer must be one of {WRITER_MODES}, not {writer!r}")
    if on_overlength not in ("truncate", "error", "skip"):
        raise ValueError(f"on_overlength must be truncate, error or skip, not {on_overlength!r}")
    check_checksum(checksum)
    check_shard_size(shard_size, fmt, writer)
    if fmt == "speculators-hs":
        if on_overlength == "skip":
            raise ValueError(
                "--format speculators-hs: --on-overlength skip would leave a dataset row with no "
                "hs_{i}.safetensors (its trainer would try to generate it): use truncate or error"
            )
        if os.path.realpath(output) == os.path.realpath(input_path):
            raise ValueError(
                f"--format speculators-hs: --output {output} is the input dataset; extract writes its "
                "own input_ids/loss_mask dataset into --output (beside hidden_states/), which would "
                "replace the input's files: give another directory"
            )
        from .trainer_dataset import require_datasets

        require_datasets()
        output = os.path.join(output, "hidden_states")  # (its trainer's layout; the dataset goes beside)
    part = resolve_part(rank, world_size)
    unit = partition_unit(batch_size, shard_size) if part.sharded else batch_size
    if part.local_size:  # (several shards on this host from one launcher: each its own GPUs)
        pick_local_devices(part, gen_kwargs.get("tensor_parallel_size") or 1)
    if part.source.endswith("(torchrun)"):
        forget_launcher_env()
    out = OutputDir(output, fmt, checksum, shard_size, part, unit)
    out.lock()  # (a second run into this output is refused here, naming the first)
    try:
        return _run_locked(
            out,
            model,
            input_path,
            layer_ids=layer_ids,
            batch_size=batch_size,
            max_samples=max_samples,
            fmt=fmt,
            on_overlength=on_overlength,
            queue_size=queue_size,
            progress=progress,
            generator=generator,
            writer_threads=writer_threads,
            layer_id_convention=layer_id_convention,
            writer=writer,
            shard_size=shard_size,
            verify_existing=verify_existing,
            self_check=self_check,
            gen_kwargs=gen_kwargs,
        )
    finally:
        out.unlock()


def _run_locked(
    out: OutputDir,
    model: str,
    input_path: str,
    *,
    layer_ids,
    batch_size,
    max_samples,
    fmt,
    on_overlength,
    queue_size,
    progress,
    generator,
    writer_threads,
    layer_id_convention,
    writer,
    shard_size,
    verify_existing,
    self_check,
    gen_kwargs,
) -> dict[str, Any]:
    from ..checkpoint import check_checkpoint, check_max_model_len, fingerprint_checkpoint, model_limits
    from ..layers import read_num_layers
    from ..layers import resolve as resolve_layers

    t0 = time.time()
    # -- before any engine: the model's files, the whole input, the output's record --------------
    check_checkpoint(model)
    limits = model_limits(model)
    if generator is None:
        check_max_model_len(gen_kwargs.get("max_model_len"), limits, model)
    if generator is None:
        n_layers = read_num_layers(model, bool(gen_kwargs.get("trust_remote_code")))
        ids_ = resolve_layers(layer_ids, n_layers, layer_id_convention, fmt)
        max_len = int(gen_kwargs.get("max_model_len") or 2048) - 1
    else:
        ids_, max_len = list(generator.layer_ids), generator.engine.max_model_len - 1
    scan = scan_input(input_path, max_samples, max_len, known=out.recorded().get("input_scan"))
    if scan.overlength and on_overlength == "error":
        i, n = scan.overlength[0]
        raise DatasetError(
            f"sample {i} has {n} tokens; at most max_model_len - 1 = {max_len} fit (use "
            f"--on-overlength truncate|skip; {len(scan.overlength)} sample(s) are over)"
        )
    scan.check_vocab(limits.get("vocab_size"))
    if scan.no_loss_mask:
        logger.warning(
            "%d of %d sample(s) have no loss_mask: every token of those counts in training (all ones)",
            scan.no_loss_mask,
            scan.samples,
        )
    if scan.overlength:
        warn_overlength(
            scan.overlength, max_len, "truncated to that length" if on_overlength == "truncate" else "skipped (no file)"
        )
    skip = {i for i, _ in scan.overlength} if on_overlength == "skip" else set()
    total = scan.samples
    run_info = {
        "model": os.path.abspath(model) if os.path.exists(model) else model,
        "input": os.path.abspath(input_path),
        "layer_ids": ids_,
        "layer_id_convention": "upstream",
        "format": fmt,
        "batch_size": batch_size,
        "max_model_len": max_len + 1,
        "on_overlength": on_overlength,
    }
    if shard_size > 1:  # (only then: an output written before shards existed still resumes)
        run_info["shard_size"] = shard_size
    if out.part.sharded:  # (likewise: absent means one engine)
        run_info["world_size"] = out.part.world_size
    if total is not None:
        out.check_total(total)
    known = (out.recorded().get("fingerprints") or {}).get("model")
    fingerprints = {"model": fingerprint_checkpoint(model, known), "input": scan.fingerprint}
    done = out.prepare(
        run_info,
        total,
        fingerprints,
        verify_existing=verify_existing,
        latest={"samples": total, "skipped_overlength": sorted(skip), "input_scan": scan.record()},
    )
    asked = dtype_name(gen_kwargs.get("dtype")) if generator is None else None
    if asked:  # (an explicit --dtype is known now; "auto" only once the engine resolved it)
        out.confirm({"dtype": asked}, record=False)
    owned = [i for i in range(total) if out.owns(i)]
    to_compute = sum(1 for i in owned if i not in done and i not in skip)
    check_free_space(out.root, scan, to_compute, len(ids_), limits.get("hidden_size"), gen_kwargs.get("dtype"))
    import torch  # (not before: the checks above need neither torch nor vLLM)

    from ..generator import token_tensor

    # -- the engine (not started when nothing is left to compute) --------------------------------
    tp = gen_kwargs.get("tensor_parallel_size") or 1
    if generator is not None:
        tp = (
            getattr(
                getattr(getattr(generator, "vllm_config", None), "parallel_config", None), "tensor_parallel_size", None
            )
            or tp
        )
    if (
        to_compute
        and shard_size == 1
        and (writer == "process" or (writer == "auto" and generator is None and _gpu_host()))
    ):
        from .procwriter import writer_pool

        writer_pool(writer_threads, tp)  # start the writer processes now: they import torch meanwhile
    own_generator = generator is None and to_compute > 0
    if own_generator:
        from ..generator import VllmHiddenStatesGenerator

        generator = VllmHiddenStatesGenerator(
            model,
            layer_ids=ids_,
            layer_id_convention="upstream",
            on_overlength="error",
            self_check=self_check,
            **gen_kwargs,
        )
    try:
        if generator is not None:
            out.confirm({"dtype": str(generator.vllm_config.model_config.dtype).replace("torch.", "")})
            if generator.engine.max_model_len - 1 < max_len:  # (vLLM lowered it: the engine's limit applies)
                max_len = generator.engine.max_model_len - 1
        t_compute = time.time()  # throughput counts from here: engine start-up is reported apart
        samples: Iterable[Sample] = open_dataset(input_path)
        if max_samples is not None:
            samples = islice(samples, max_samples)
        writer_mode = "thread" if shard_size > 1 or generator is None else choose_writer(writer, generator)
        if shard_size > 1:
            writer = ShardWriter(out, queue_size, writer_threads)
        elif writer_mode == "process":
            describe = getattr(generator.engine, "describe", None) or (lambda t: None)
            writer = ProcessWriter(out, describe, queue_size, writer_threads, gpu_workers=tp)
        else:
            writer = BackgroundWriter(out, queue_size, writer_threads)
        # the worker's arena: one slab per batch the writer may hold, plus the one being computed,
        # made at the first batch (not one by one, mid-run, as the writers fall behind)
        slabs = max(1, queue_size) + 2
        if total is not None:
            slabs = min(slabs, max(1, -(-(len(owned) - len(done)) // batch_size)))
        set_slabs = getattr(getattr(generator, "engine", None), "set_arena_slabs", None)
        if set_slabs is not None:
            set_slabs(slabs)
        bar = progress_bar(len(owned), progress)
        engine = getattr(generator, "engine", None)
        check_stats = getattr(engine, "self_check_stats", None)
        checked_before = check_stats.as_dict() if check_stats is not None else None
        check_was = getattr(engine, "self_check", None)
        if check_was is not None:
            engine.self_check = self_check  # (a given generator's own setting comes back afterwards)
        stats = {
            "samples_seen": 0,
            "skipped_done": 0,
            "computed": 0,
            "written_new": 0,
            "tokens": 0,
            "truncated": [],
            "skipped_overlength": [],
        }
        n_seen = 0
        generate_s = put_s = read_s = 0.0
        batches = _Prefetch(_batches(samples, batch_size))
        try:
            while True:
                t_read = time.perf_counter()
                try:
                    batch = batches.next()
                except DatasetError:
                    check_unchanged(input_path, scan)  # (a line torn by a rewrite: the rewrite is the news)
                    raise
                read_s += time.perf_counter() - t_read  # (waiting for it: reading overlaps the engine)
                check_unchanged(input_path, scan)  # (after the batch was read: a change during it shows)
                if batch is None:
                    break
                n_seen += len(batch)
                if not out.owns(batch[0].index):
                    continue  # another rank's batch (a batch never spans two ranks' units)
                todo = [s for s in batch if s.index not in done and s.index not in skip]
                if not todo:
                    stats["skipped_done"] += len(batch)
                    bar.update(len(batch))
                    continue
                ids, masks, keep = [], [], []
                for s in batch:
                    x, m = s.input_ids, s.loss_mask
                    if len(x) > max_len:
                        if on_overlength == "error":
                            raise DatasetError(
                                f"sample {s.index} has {len(x)} tokens; at most max_model_len - 1 "
                                f"= {max_len} fit (use --on-overlength truncate|skip)"
                            )
                        if on_overlength == "skip":
                            stats["skipped_overlength"].append(s.index)
                            continue
                        stats["truncated"].append(s.index)
                        x, m = x[:max_len], (m[:max_len] if m is not None else None)
                    ids.append(x)
                    masks.append(m)
                    keep.append(s)
                if not keep:
                    bar.update(len(batch))
                    continue
                t_gen = time.perf_counter()
                try:
                    results = generator.generate(ids)
                except TokenIdError as e:  # name the sample, not its place in the batch
                    raise DatasetError(e.message(f"sample {keep[e.seq].index}")) from e
                generate_s += time.perf_counter() - t_gen
                items = []
                for s, r, m in zip(keep, results, masks):
                    if s.index in done:
                        continue
                    lm = token_tensor(m) if m is not None else torch.ones(len(r["input_ids"]), dtype=torch.long)
                    items.append(
                        (s.index, {"input_ids": r["input_ids"], "hidden_states": r["hidden_states"], "loss_mask": lm})
                    )
                    stats["tokens"] += len(r["input_ids"])
                    if "hidden_size" not in stats:  # (recorded: a later run with nothing to compute reports it)
                        stats["hidden_size"] = int(r["hidden_states"][0].shape[-1])
                        out.confirm({"hidden_size": stats["hidden_size"]})
                stats["computed"] += len(keep)
                stats["written_new"] += len(items)
                stats["skipped_done"] += len(batch) - len(todo)
                t_put = time.perf_counter()
                writer.put(items, upto=n_seen)  # every index below n_seen is handed over
                put_s += time.perf_counter() - t_put
                bar.update(len(batch))
                bar.set_postfix_str(f"{stats['tokens'] / max(time.time() - t_compute, 1e-9):,.0f} tok/s", refresh=False)
            stats["samples_seen"] = n_seen
            writer.finish(n_seen)  # (shards: the last one, however short, may be written)
            check_unchanged(input_path, scan, final=True)  # (before a manifest says the dataset is whole)
        finally:
            if set_slabs is not None:
                set_slabs(0)  # later plain generate() calls hold nothing: slabs made as needed
            if check_was is not None:
                engine.self_check = check_was
            batches.close()
            bar.close()
            try:
                writer.close()
            except Exception as e:  # don't mask the original error; report the writer's own failure
                if sys.exc_info()[0] is None:
                    raise
                logger.error("writer failed while handling another error: %s", e)
        write_s = time.time() - t_compute  # from the first batch to the last file written
        write_mib_s = writer.bytes_written / 2**20 / max(write_s, 1e-9)
        write_bound = _warn_if_write_bound(writer.wait_s, write_s, write_mib_s, out.root)
        extra = {
            "model": run_info["model"],
            "layer_ids": run_info["layer_ids"],
            "num_samples": n_seen,
            "truncated": [i for i, _ in scan.overlength] if on_overlength == "truncate" else [],
            "skipped_overlength": sorted(skip),
            "versions": versions.report(),
            "hidden_size": stats.get("hidden_size") or out.recorded().get("hidden_size"),
        }
        if fmt == "speculators-hs":  # (its trainer's config names them as vLLM does)
            extra["layer_ids_vllm"] = [i + 1 for i in ids_]
        if out.part.sharded:  # this rank's files; the manifest comes when every rank is done
            mine = out.checksum_records().values()
            files_now, bytes_now = len(mine), sum(r["bytes"] for r in mine)
        else:
            manifest = out.finalize(n_seen, extra=extra)
            files_now, bytes_now = manifest["num_files"], manifest["total_bytes"]
        took = time.time() - t0
        summary = {
            "output": str(out.root),
            "samples": n_seen,
            "files": files_now,
            "new_files": stats["written_new"],
            "already_done": stats["skipped_done"],
            "computed": stats["computed"],
            "tokens_computed": stats["tokens"],
            "bytes": bytes_now,
            "seconds": round(took, 2),
            "engine_start_s": round(t_compute - t0, 2),
            "tokens_per_s": round(stats["tokens"] / max(time.time() - t_compute, 1e-9), 1),
            "truncated": len(stats["truncated"]),
            "skipped_overlength": len(stats["skipped_overlength"]),
            "writer": writer_mode,
            "batch_size": batch_size,
            **({"shard_size": shard_size} if shard_size > 1 else {}),
            # where the time went (s): engine calls, reading input, handing batches to the
            # writer, waiting for it while batches were in flight, and for the last writes
            "generate_s": round(generate_s, 3),
            "read_s": round(read_s, 3),
            "handoff_s": round(put_s - writer.wait_s - writer.start_wait_s, 3),
            "writer_wait_s": round(writer.wait_s, 3),
            "writer_tail_s": round(writer.tail_s, 3),
            # waiting for writer processes to start (their torch import): not the disk
            "writer_start_s": round(writer.start_wait_s, 3),
            # writing back what the page cache still held, before the manifest: the disk's pace
            "sync_s": round(out.sync_s, 3),
            # what this run wrote, and how fast (over the whole compute phase)
            "bytes_written": writer.bytes_written,
            "write_mib_per_s": round(write_mib_s, 1),
            "write_bound": write_bound,
            # every computed request's sampled token against its captured state (engine/selfcheck.py);
            # None: the check was off (or the engine had none to run)
            "self_check": check_stats.since(checked_before) if check_stats is not None and self_check else None,
        }
        if writer_mode == "process":
            summary["files_by_writer_processes"] = writer.in_processes
        if out.part.sharded:
            summary.update(rank=out.part.rank, world_size=out.part.world_size)
            out.mark_done(n_seen, extra, summary)
            summary["dataset_complete"] = (
                out.finalize_if_complete() is not None or (out.root / "manifest.json").exists()
            )
            if summary["dataset_complete"]:
                logger.info("%s: every rank is done; manifest.json written for the whole dataset", out.part.label)
            else:
                waiting = sorted(set(range(out.part.world_size)) - set(out.ranks_done()))
                logger.info("%s done; the dataset waits for rank(s) %s", out.part.label, ", ".join(map(str, waiting)))
        with open(out.records / "runs.jsonl", "a") as f:  # timings live here, not in the manifest
            f.write(json.dumps(summary) + "\n")
        return summary
    finally:
        if own_generator and generator is not None:  # ours to close: its workers and /dev/shm arena go with it
            generator.close()


WRITE_BOUND_SHARE = 0.1  # of the compute phase spent waiting for the writers ...
WRITE_BOUND_MIN_S = 1.0  # ... and at least this long: then the run is said to be write-bound


def _warn_if_write_bound(wait_s: float, write_s: float, write_mib_s: float, root) -> bool:
    """Say so (a warning) when the engine spent a real share of the run waiting for room in the
    writers' queue: the output disk, not the engine, then sets the pace. On the H200 host the
    pipeline kept 0.896 of generate() over 64 batches written to tmpfs, and 0.738 written to its
    disk, which sustains ~1.2 GiB/s against the 4.4 GiB/s of hidden states produced
    (docs/benchmarks.md): nothing in the pipeline can go faster than the disk."""
    if wait_s < max(WRITE_BOUND_MIN_S, WRITE_BOUND_SHARE * write_s):
        return False
    logger.warning(
        "the engine waited %.1f s of %.1f s (%.0f%%) for the file writers, which wrote %.0f MiB/s to "
        "%s: this run is bound by writing its output. A faster output disk would speed it up, or "
        "more writers (--writer-threads) if that disk is not busy.",
        wait_s,
        write_s,
        100 * wait_s / max(write_s, 1e-9),
        write_mib_s,
        root,
    )
    return True

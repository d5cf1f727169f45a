"""``speculators-compat extract``: the command line to the pipeline, for one engine
(extract.py), several on this host (parallel.py) or a Ray cluster (ray_shards.py)."""

from __future__ import annotations

import json


def main_extract(args) -> int:
    if args.dry_run:
        from .plan import main_plan

        return main_plan(args)
    kw = dict(
        layer_ids=args.layer_ids,
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        fmt=args.format,
        on_overlength=args.on_overlength,
        queue_size=args.queue_size,
        progress=not args.no_progress,
        writer_threads=args.writer_threads,
        writer=args.writer,
        checksum=args.checksum,
        shard_size=args.shard_size,
        verify_existing=args.verify_existing,
        layer_id_convention=args.layer_id_convention,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        quantization=args.quantization,
        trust_remote_code=args.trust_remote_code,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_expert_parallel=args.enable_expert_parallel,
        async_scheduling=args.async_scheduling,
        self_check=not args.no_self_check,
    )
    where = (args.model, args.input, args.output)
    if args.ray is not None:
        if args.rank is not None or args.world_size is not None:
            raise ValueError("--ray places every shard itself: leave out --rank/--world-size")
        from .ray_shards import run_on_ray

        summary = run_on_ray(*where, shards=args.data_parallel_size, address=args.ray or None, **kw)
    elif (args.data_parallel_size or 1) > 1:
        from .parallel import run_data_parallel

        summary = run_data_parallel(
            *where, data_parallel_size=args.data_parallel_size, rank=args.rank, world_size=args.world_size, **kw
        )
    else:
        from .extract import run_extract

        summary = run_extract(*where, rank=args.rank, world_size=args.world_size, **kw)
    print("summary: " + json.dumps(summary))
    return 0

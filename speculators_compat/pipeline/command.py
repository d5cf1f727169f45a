"""``speculators-compat extract``: the command line to the pipeline, for one engine
(extract.py), several on this host (parallel.py) or a Ray cluster (ray_shards.py)."""

from __future__ import annotations

import json

from .options import ExtractOptions


def main_extract(args) -> int:
    if args.dry_run:
        from .plan import main_plan

        return main_plan(args)
    opts = ExtractOptions.from_args(args)
    where = (args.model, args.input, args.output)
    if args.ray is not None:
        if args.rank is not None or args.world_size is not None:
            raise ValueError("--ray places every shard itself: leave out --rank/--world-size")
        from .scale.ray_shards import run_on_ray

        summary = run_on_ray(*where, opts, shards=args.data_parallel_size, address=args.ray or None)
    elif (args.data_parallel_size or 1) > 1:
        from .scale.parallel import run_data_parallel

        summary = run_data_parallel(
            *where, opts, data_parallel_size=args.data_parallel_size, rank=args.rank, world_size=args.world_size
        )
    else:
        from .extract import run_extract

        summary = run_extract(*where, opts, rank=args.rank, world_size=args.world_size)
    print("summary: " + json.dumps(summary))
    return 0

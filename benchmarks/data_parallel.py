#!/usr/bin/env python3
"""Data-parallel efficiency: ``extract --data-parallel-size D`` against one engine, same work.

Each round extracts the same input twice into fresh directories (which goes first alternates):
once with one engine on all the resources, once with D engines splitting them, and reports the
compute-phase throughput of each (tokens over the time from the first batch to the last file;
for D engines, over the longest engine's), the wall time with engine start-up, and their ratios.

    # CPU: one engine on both cores against 2 engines of one core each
    python benchmarks/data_parallel.py --model llama --samples 64 --seq 512 --dtype float32
    # one GPU: one engine against 2 engines sharing it, each with half the memory
    python benchmarks/data_parallel.py --model llama-1b --samples 512 --seq 1024 --dtype bfloat16 --share-gpu

On a CPU host the resources are the usable cores (``VLLM_CPU_OMP_THREADS_BIND`` all of them for the
one engine, disjoint halves for the two); with ``--share-gpu`` both engines run on GPU 0 with
``--gpu-memory-utilization`` split between them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="tiny model name (llama, llama-100m, llama-1b) or a path")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--share-gpu", action="store_true", help="all engines on GPU 0, its memory split between them")
    ap.add_argument(
        "--work",
        default=None,
        help="directory for the input and outputs (default: a temp dir; tmpfs keeps the disk out of it)",
    )
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from speculators_compat import versions
    from speculators_compat.pipeline.extract import run_extract
    from speculators_compat.pipeline.scale.parallel import run_data_parallel
    from speculators_compat.testing import models

    path = a.model if os.path.isdir(a.model) else str(models.build(a.model))
    work = tempfile.mkdtemp(prefix="dp-bench-", dir=a.work)
    inp = os.path.join(work, "in.jsonl")
    with open(inp, "w") as f:
        for ids in models.random_prompts([a.seq] * a.samples, seed=13):
            f.write(json.dumps({"input_ids": ids}) + "\n")
    kw = dict(
        batch_size=a.batch_size,
        dtype=a.dtype,
        max_model_len=max(2048, a.seq + 8),
        max_num_batched_tokens=a.max_num_batched_tokens,
        progress=False,
    )
    cpus = sorted(os.sched_getaffinity(0))
    one_env = {}
    if a.share_gpu:
        dp_kw = dict(devices=[["0"]] * a.engines, gpu_memory_utilization=a.gpu_memory_utilization / a.engines)
    else:
        dp_kw = {}
        if not os.environ.get("CUDA_VISIBLE_DEVICES") and not _has_gpu():
            one_env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}  # (auto would keep one for itself)

    def one(out):
        old = {k: os.environ.get(k) for k in one_env}
        os.environ.update(one_env)
        try:
            return run_extract(path, inp, out, gpu_memory_utilization=a.gpu_memory_utilization, **kw)
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def many(out):
        extra = dict(kw, gpu_memory_utilization=dp_kw.get("gpu_memory_utilization", a.gpu_memory_utilization))
        return run_data_parallel(path, inp, out, data_parallel_size=a.engines, devices=dp_kw.get("devices"), **extra)

    rows = []
    for r in range(a.rounds):
        order = [("one", one), ("dp", many)] if r % 2 == 0 else [("dp", many), ("one", one)]
        got = {}
        for name, fn in order:
            out = os.path.join(work, f"{name}-{r}")
            t = time.perf_counter()
            s = fn(out)
            got[name] = {"tokens_per_s": s["tokens_per_s"], "wall_s": round(time.perf_counter() - t, 2)}
            shutil.rmtree(out)
        rows.append(got)
        print(f"round {r}: one engine {got['one']}, {a.engines} engines {got['dp']}", flush=True)
    med = {k: statistics.median(row[k]["tokens_per_s"] for row in rows) for k in ("one", "dp")}
    wall = {k: statistics.median(row[k]["wall_s"] for row in rows) for k in ("one", "dp")}
    res = {
        "model": a.model,
        "samples": a.samples,
        "seq": a.seq,
        "batch_size": a.batch_size,
        "engines": a.engines,
        "share_gpu": a.share_gpu,
        "dtype": a.dtype,
        "cpus": len(cpus),
        "work": work,
        "versions": versions.report(),
        "rounds": rows,
        "median_tokens_per_s": med,
        "ratio_tokens_per_s": round(med["dp"] / med["one"], 3),
        "median_wall_s": wall,
        "ratio_wall": round(wall["one"] / wall["dp"], 3),
    }
    print(
        f"median compute-phase tokens/s: one engine {med['one']:,.0f}, {a.engines} engines {med['dp']:,.0f} "
        f"(ratio {res['ratio_tokens_per_s']}); wall with start-up: {wall['one']} s vs {wall['dp']} s "
        f"(speed-up {res['ratio_wall']})"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _has_gpu() -> bool:
    from speculators_compat.host import cuda_device_count

    return cuda_device_count() > 0


if __name__ == "__main__":
    raise SystemExit(main())

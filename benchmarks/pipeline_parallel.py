#!/usr/bin/env python3
"""Pipeline parallelism against tensor parallelism and one worker, the same work, measured in one run.

Configurations (same model, dtype, max_model_len, max_num_batched_tokens, prompts), one engine at a
time, each warmed up once and then fed ``--batches`` batches of ``--batch`` prompts per round,
``--reps`` rounds:
  tp1       one worker
  tp2       tensor parallel 2
  pp2       pipeline parallel 2, both stages' rows through /dev/shm
  pp2-rpc   pipeline parallel 2 over two "hosts" on this machine (vLLM's multiprocessing executor over
            nodes: ``speculators-compat node --node-rank 1`` holds stage 1, started with
            SPECULATORS_COMPAT_HANDOFF=rpc): stage 1's rows come back in its RPC replies
Reported per configuration: tokens/s (median over rounds, and the spread), its ratio to tp1, and the
transport's share: the driver's time taking a batch's rows (the take call, its replies, the copy out
of the arena) over the whole batch.
    python benchmarks/pipeline_parallel.py --model llama-100m --batch 16 --seq 256 --batches 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

CONFIGS = ("tp1", "tp2", "pp2", "pp2-rpc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_kwargs(name: str, args, port: int) -> dict:
    kw = dict(max_model_len=args.seq + 8, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    if name == "tp2":
        kw["tensor_parallel_size"] = 2
    if name.startswith("pp2"):
        kw["pipeline_parallel_size"] = 2
    if name == "pp2-rpc":
        kw.update(nnodes=2, master_addr="127.0.0.1", master_port=port)
    return kw


def _start_node(path: str, args, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "speculators_compat.cli",
        "node",
        "--model",
        path,
        "--pipeline-parallel-size",
        "2",
        "--max-model-len",
        str(args.seq + 8),
        "--dtype",
        args.dtype,
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    env = dict(os.environ, SPECULATORS_COMPAT_HANDOFF="rpc", VLLM_CPU_OMP_THREADS_BIND="1")
    return subprocess.Popen(cmd, env=env)


def measure(name: str, path: str, layers: list, batches: list, args) -> dict:
    from speculators_compat import VllmHiddenStatesGenerator

    port = _free_port()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if name in ("tp1", "pp2-rpc") else "0|1"
    node = _start_node(path, args, port) if name == "pp2-rpc" else None
    try:
        with VllmHiddenStatesGenerator(path, layer_ids=layers, **_engine_kwargs(name, args, port)) as g:
            g.generate(batches[0])  # warm-up
            rates, shares = [], []
            tokens = sum(len(p) for b in batches for p in b)
            for _ in range(args.reps):
                before = dict(g.engine.timings)
                t0 = time.perf_counter()
                for b in batches:
                    g.generate(b)
                wall = time.perf_counter() - t0
                rates.append(tokens / wall)
                shares.append((g.engine.timings["handoff_s"] - before["handoff_s"]) / wall)
            stages = g.engine.model_info.get("stages")
    finally:
        if node is not None:
            node.wait(timeout=120)
    return {
        "tokens_per_s": statistics.median(rates),
        "spread": [min(rates), max(rates)],
        "transport_share": statistics.median(shares),
        "stages": stages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-100m", help="tiny model name (llama, llama-100m) or a path")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from speculators_compat.layers import default_layer_ids, read_num_layers
    from speculators_compat.testing import models

    path = args.model if os.path.isdir(args.model) else str(models.build(args.model))
    layers = default_layer_ids(read_num_layers(path))
    prompts = models.random_prompts([args.seq] * (args.batch * args.batches), seed=1)
    batches = [prompts[i * args.batch : (i + 1) * args.batch] for i in range(args.batches)]
    out = {"model": args.model, "batch": args.batch, "seq": args.seq, "batches": args.batches, "layers": layers}
    for name in args.configs.split(","):
        out[name] = measure(name, path, layers, batches, args)
        print(name, json.dumps(out[name]), flush=True)
    base = out.get("tp1", {}).get("tokens_per_s")
    print(f"\n{'config':10} {'tokens/s':>10} {'vs tp1':>8} {'transport':>10}")
    for name in args.configs.split(","):
        r = out[name]
        ratio = f"{r['tokens_per_s'] / base:.3f}" if base else "-"
        print(f"{name:10} {r['tokens_per_s']:10.0f} {ratio:>8} {r['transport_share']:10.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What the self-check costs: ``generate()`` with it on against the same engine with it off.

One engine; each round runs every batch twice, back to back, once checked and once not
(``engine.self_check`` switched between the calls, which goes first alternating), and the table
gives the median tokens/s of each, their ratio, and the median over all pairs of one batch's
checked time over its unchecked time. The time spent inside the check is measured
too, where it happens: in the worker (``self_check_s``: gathering the rows, the final norm,
compute_logits, top-k) and in the driver (``check_s``: the verdict), as a share of the checked
runs' time. Also printed: what the check counted (requests, near-ties, largest gap that passed).

    python benchmarks/self_check.py --model llama --batch 16 --seq 256 --dtype float32
    python benchmarks/self_check.py --model llama-1b --batch 32 --seq 1024 --batches 8 --dtype bfloat16  # a GPU
``--layers`` without the last layer measures the path that keeps the final layer's row for the
check alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="tiny model name (llama, llama-100m, llama-1b) or a path")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--layers", default=None, help="comma-separated layer ids (default: upstream's 4)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    import speculators_compat  # noqa: F401
    from speculators_compat import VllmHiddenStatesGenerator, versions
    from speculators_compat.testing import models

    if torch.cuda.is_available():
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    path = a.model if os.path.isdir(a.model) else str(models.build(a.model))
    prompts = models.random_prompts([a.seq] * (a.batch * a.batches), seed=11)
    batches = [prompts[i : i + a.batch] for i in range(0, len(prompts), a.batch)]
    tokens = a.seq * len(prompts)
    layers = [int(x) for x in a.layers.split(",")] if a.layers else None
    gen = VllmHiddenStatesGenerator(
        path,
        layer_ids=layers,
        max_model_len=max(2048, a.seq + 8),
        dtype=a.dtype,
        max_num_batched_tokens=a.max_num_batched_tokens,
        gpu_memory_utilization=a.gpu_memory_utilization,
    )
    eng = gen.engine

    def call(b, checked: bool) -> tuple[float, float, float]:  # seconds; worker and driver seconds in the check
        eng.self_check = checked
        w0, d0 = eng.stats()["self_check_s"], eng.timings["check_s"]
        t = time.perf_counter()
        gen.generate(b)
        dt = time.perf_counter() - t
        return dt, eng.stats()["self_check_s"] - w0, eng.timings["check_s"] - d0

    for b in batches:  # warm-up, both ways
        call(b, True)
        call(b, False)
    before = eng.self_check_stats.as_dict()
    on, off, worker_s, driver_s, pairs = [], [], [], [], []
    for r in range(a.reps):  # each round: every batch both ways, back to back, the order alternating
        t_on = t_off = w_sum = d_sum = 0.0
        for k, b in enumerate(batches):
            first = (r + k) % 2 == 0
            got = {}
            for checked in (first, not first):
                got[checked] = call(b, checked)
            pairs.append(got[True][0] / got[False][0])
            t_on += got[True][0]
            t_off += got[False][0]
            w_sum += got[True][1]
            d_sum += got[True][2]
        on.append(t_on)
        off.append(t_off)
        worker_s.append(w_sum)
        driver_s.append(d_sum)
    counted = eng.self_check_stats.since(before)
    gen.close()
    tok_on, tok_off = tokens / statistics.median(on), tokens / statistics.median(off)
    figures = {
        "env": {
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu x{os.cpu_count()}",
            "vllm": versions.installed("vllm"),
            "model": a.model,
            "dtype": a.dtype,
            "batch": a.batch,
            "seq": a.seq,
            "batches": a.batches,
            "layer_ids": list(gen.layer_ids),
            "last_layer_captured": gen.num_layers - 1 in gen.layer_ids,
        },
        "tok_s_checked": round(tok_on, 1),
        "tok_s_unchecked": round(tok_off, 1),
        "checked_over_unchecked": round(tok_on / tok_off, 4),
        # each batch's checked time over its unchecked time, the two calls back to back: the median
        "paired_time_ratio_median": round(statistics.median(pairs), 4),
        "share_in_worker_check": round(statistics.median(w / t for w, t in zip(worker_s, on)), 5),
        "share_in_driver_check": round(statistics.median(d / t for d, t in zip(driver_s, on)), 5),
        "runs_s": {"checked": on, "unchecked": off},
        "self_check": counted,
    }
    print(json.dumps(figures["env"]))
    print("| generate() | tokens/s (median) | spread (min-max) | runs |")
    print("|---|---|---|---|")
    for name, ts in (("self-check on", on), ("self-check off", off)):
        print(
            f"| {name} | {tokens / statistics.median(ts):,.0f} | {tokens / max(ts):,.0f} - {tokens / min(ts):,.0f} | {len(ts)} |"
        )
    print(
        f"on/off = {figures['checked_over_unchecked']:.4f} (tokens/s); per batch, checked time over unchecked "
        f"(median of {len(pairs)} back-to-back pairs) {figures['paired_time_ratio_median']:.4f}; time inside the check: worker "
        f"{figures['share_in_worker_check']:.3%}, driver {figures['share_in_driver_check']:.3%} of the checked runs"
    )
    print("counted:", json.dumps(counted))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

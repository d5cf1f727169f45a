#!/usr/bin/env python3
"""Extraction time: unmodified speculators 0.3.0 vs the same script + `import speculators_compat`.

Only meaningful on vLLM 0.11 (the one version where upstream runs at all; it gets a stand-in for its
CUDA-only `torch.cuda.mem_get_info` on CPU). One batch that fits one scheduler step (upstream is
right there), timed 3 times after a warm-up, each variant in its own fresh interpreter.
    $(python3 scripts/engine_env.py python 0.11.0) benchmarks/upstream_vs_patched.py --batch 64 --seq 128
"""

import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, os, sys, time
    def main():
        import torch
        if not torch.cuda.is_available():
            torch.cuda.mem_get_info = lambda *a: (4 << 30, 8 << 30)
        import speculators_compat  # a no-op when SPECULATORS_COMPAT_DISABLE=1
        from speculators_compat.testing import models
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        path = str(models.build(sys.argv[1]))
        prompts = models.random_prompts([int(sys.argv[3])] * int(sys.argv[2]), seed=1)
        t = time.time()
        gen = VllmHiddenStatesGenerator(path, layer_ids=[1, 3, 5], max_model_len=2048)
        start = time.time() - t
        gen.generate(prompts)
        times = []
        for _ in range(3):
            t = time.time(); gen.generate(prompts); times.append(time.time() - t)
        print("@@" + json.dumps({"startup_s": start, "times": times}))
        gen.__del__()
    if __name__ == "__main__":
        main()
""")


def run(disable: bool, a) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR")
    if disable:
        env["SPECULATORS_COMPAT_DISABLE"] = "1"
    p = subprocess.run(
        [sys.executable, "-c", CHILD, a.model, str(a.batch), str(a.seq)], capture_output=True, text=True, env=env
    )
    for line in p.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    raise SystemExit(f"child failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    tokens = a.batch * a.seq
    res = {}
    for name, disable in (("upstream", True), ("patched", False), ("upstream#2", True), ("patched#2", False)):
        r = run(disable, a)
        res[name] = r
        print(
            f"{name:<11} start-up {r['startup_s']:.1f}s  generate "
            + " ".join(f"{tokens / t:,.0f}" for t in r["times"])
            + " tok/s",
            flush=True,
        )
    best = {k: tokens / min(r["times"]) for k, r in res.items()}
    up = max(best["upstream"], best["upstream#2"])
    pa = max(best["patched"], best["patched#2"])
    print(f"ratios: patched/upstream = {pa / up:.3f} (best of 6 calls each; {tokens} tokens per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

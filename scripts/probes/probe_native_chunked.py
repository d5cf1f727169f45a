#!/usr/bin/env python3
"""vLLM's own hidden-state extractor against HF transformers, prompt by prompt, when the scheduler
splits prompts over several engine steps (chunked prefill).

Runs ``LLM.generate(max_tokens=1)`` with ``speculative_config`` method ``extract_hidden_states`` and
``ExampleHiddenStatesConnector`` (on CPU, where the connector's copy is CUDA-only, the benchmark's
CPU stand-in) on a built-in tiny model, prompts of mixed lengths and a small token budget per step,
then compares every prompt's file with HF float32 per layer (relative Frobenius error). Prompts
longer than the budget are split; so are shorter ones that do not fit in what a step has left.

    PYTHONPATH=$PWD python scripts/probes/probe_native_chunked.py --json native-chunked.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--lengths", default="20,600", help="LO,HI: prompt lengths drawn (seeded) from this range")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import native

    from speculators_compat import versions
    from speculators_compat.layers import default_layer_ids, read_num_layers
    from speculators_compat.testing import models
    from speculators_compat.testing.reference import HFReference, tolerance_for

    path = a.model if os.path.isdir(a.model) else str(models.build(a.model))
    n = read_num_layers(path)
    native_ids = sorted({i + 1 for i in default_layer_ids(n)})  # vLLM's ids: output of i layers
    lo, hi = (int(x) for x in a.lengths.split(","))
    rng = random.Random(11)
    lengths = [rng.randint(lo, hi) for _ in range(a.prompts)]
    prompts = models.random_prompts(lengths, seed=11)
    store = tempfile.mkdtemp(prefix="native-chunked-")
    args = native.engine_kwargs(store, native_ids, torch.cuda.is_available())
    llm = LLM(
        model=path,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        dtype=a.dtype,
        max_model_len=max(2048, hi + 8),
        max_num_batched_tokens=a.max_num_batched_tokens,
        **args,
    )
    kv = args["kv_transfer_config"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0.0))
    files = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    deadline = time.monotonic() + 120
    while not all(native.file_complete(f) for f in files):
        if time.monotonic() > deadline:
            raise RuntimeError("native files not complete after 120 s")
        time.sleep(0.05)
    ref = HFReference(path, [i - 1 for i in native_ids])
    tol = tolerance_for(a.dtype)
    rows = []
    for i, (f, p) in enumerate(zip(files, prompts, strict=True)):
        got = load_file(f)["hidden_states"].float()  # [tokens, layers, hidden]
        want = ref(p)
        rel = []
        for j in range(len(native_ids)):
            d = got[:, j] - want[j]
            rel.append(float(d.norm() / want[j].norm().clamp_min(1e-12)))
        # where along the prompt the error is: the first position whose row differs beyond tolerance
        pos_rel = [
            (got[t] - torch.stack([w[t] for w in want])).norm() / torch.stack([w[t] for w in want]).norm()
            for t in range(len(p))
        ]
        first_bad = next((t for t, r in enumerate(pos_rel) if float(r) > tol), None)
        rows.append(
            {
                "prompt": i,
                "tokens": len(p),
                "rel_per_layer": [round(r, 8) for r in rel],
                "first_bad_position": first_bad,
            }
        )
    bad = [r for r in rows if max(r["rel_per_layer"]) > tol]
    report = {
        "vllm": versions.installed("vllm"),
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "connector": kv["kv_connector"],
        "model": a.model,
        "dtype": a.dtype,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "layer_ids_native": native_ids,
        "tolerance": tol,
        "prompts": rows,
        "prompts_beyond_tolerance": len(bad),
        "worst_rel": max(max(r["rel_per_layer"]) for r in rows),
    }
    for r in rows:
        flag = "WRONG" if max(r["rel_per_layer"]) > tol else "ok"
        print(
            f"prompt {r['prompt']:2d} ({r['tokens']:4d} tokens): worst rel {max(r['rel_per_layer']):.2e} {flag}"
            + (f", first wrong position {r['first_bad_position']}" if r["first_bad_position"] is not None else "")
        )
    print(
        f"vLLM {report['vllm']} {report['connector']}: {len(bad)} of {len(rows)} prompts beyond {tol} "
        f"(worst {report['worst_rel']:.3g})"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's main job: unmodified speculators 0.3.0 + ``import speculators_compat`` on a built-in
tiny model, checked against HF transformers, sequence by sequence and layer by layer."""

from __future__ import annotations

import os
import time


def run_demo(model: str = "llama") -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import speculators_compat  # noqa: F401  (the one-line change a user makes)

    from . import versions
    from .testing import models, reference

    print(
        f"speculators-compat demo: vLLM {versions.installed('vllm')}, torch {versions.installed('torch')}, "
        f"transformers {versions.installed('transformers')}, speculators {versions.installed('speculators')}"
    )
    path = str(models.build(model))
    layers = [1, 3, 5] if model != "deepseek_v3" else [0, 2, 3]
    lengths = [5, 700, 37, 120, 300, 17, 64, 8, 512, 50, 99, 10, 11]
    prompts = models.random_prompts(lengths, seed=42)
    t0 = time.time()
    try:
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        source = "speculators 0.3.0 VllmHiddenStatesGenerator (unmodified, patched at import)"
        gen = VllmHiddenStatesGenerator(path, layer_ids=layers, max_model_len=1024)
    except ImportError:
        from .generator import VllmHiddenStatesGenerator

        source = "speculators_compat.VllmHiddenStatesGenerator (speculators not installed)"
        gen = VllmHiddenStatesGenerator(path, layer_ids=layers, max_model_len=1024)
    print(f"model: tiny {model} ({path}); generator: {source}; engine ready in {time.time() - t0:.1f}s")
    t1 = time.time()
    results = gen.generate(prompts)
    dt = time.time() - t1
    dtype = results[0]["hidden_states"][0].dtype
    tol = reference.tolerance_for(dtype)
    ref = reference.HFReference(path, layers)
    print(
        f"{len(prompts)} prompts, {sum(lengths)} tokens in {dt:.2f}s; captured dtype {dtype}; "
        f"layers {layers}; tolerance rel. err <= {tol:g}"
    )
    print(f"{'seq':>4} {'tokens':>6} " + " ".join(f"{'layer ' + str(lid):>11}" for lid in layers))
    failures = 0
    for i, (r, p) in enumerate(zip(results, prompts)):
        ok = r["input_ids"].tolist() == p
        errs = []
        for j, lid in enumerate(layers):
            worst, bad = reference.compare([[r["hidden_states"][j]]], [p], ref, tol, layer_ids=[lid])
            errs.append(worst)
            failures += bool(bad)
        failures += not ok
        print(f"{i:>4} {len(p):>6} " + " ".join(f"{e:>11.2e}" for e in errs) + ("" if ok else "  ORDER WRONG"))
    gen.__del__()  # (upstream's class has no close(): its __del__, patched, shuts our engine down)
    verdict = "MATCHES HF" if failures == 0 else f"{failures} MISMATCHES"
    print(f"result: {verdict} (per sequence and layer, relative Frobenius error vs HF float32)")
    return 0 if failures == 0 else 1

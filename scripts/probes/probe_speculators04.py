#!/usr/bin/env python3
"""What speculators 0.4.x's own ``VllmHiddenStatesGenerator`` returns on the installed vLLM, with or
without this library: one batch of prompts of distinct lengths (more than 10, some split over
scheduler steps), and for each returned row the input it belongs to (found by its ``input_ids``)
and whether its states match HF's; then a second call, the prompts reversed. Prints one JSON line.

    # speculators 0.4.0 beside an engine environment's own packages (which hold 0.3.0):
    pip install --no-deps --target /tmp/sp040 speculators==0.4.0
    SPECULATORS_COMPAT_DISABLE=1 PYTHONPATH=/tmp/sp040 $PY scripts/probes/probe_speculators04.py   # unpatched

On a CPU engine 0.4.x stops at start asking CUDA for free memory (``mem_get_info``);
``PROBE_STUB_CUDA_MEMORY=1`` answers that call with 8 of 16 GiB so the rest can be seen.
"""

from __future__ import annotations

import json
import os
import traceback

LENGTHS = [300, 5, 120, 37, 450, 17, 64, 8, 250, 50, 99, 10, 700, 11]  # 14 prompts


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch  # noqa: F401

    from speculators_compat.testing import models, reference

    path = str(models.build("llama"))
    layers = [1, 3, 5]
    prompts = models.random_prompts(LENGTHS, seed=4)
    from importlib.metadata import version

    out = {"speculators": version("speculators"), "patched": os.environ.get("SPECULATORS_COMPAT_DISABLE") != "1"}
    try:
        from vllm import __version__ as vv

        out["vllm"] = vv
        if out["patched"]:
            import speculators_compat  # noqa: F401
        import speculators.data_generation.vllm_hidden_states_generator as g04
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        if os.environ.get("PROBE_STUB_CUDA_MEMORY") == "1":  # (0.4.x asks CUDA for free memory at start)
            g04.mem_get_info = lambda: (8 << 30, 16 << 30)
            out["stubbed"] = "mem_get_info"

        gen = VllmHiddenStatesGenerator(path, layer_ids=layers, max_model_len=2048, max_num_batched_tokens=512)
        res = gen.generate(prompts)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["where"] = [ln.strip() for ln in traceback.format_exc().strip().splitlines() if "File" in ln][-4:]
        print("PROBE " + json.dumps(out))
        return
    ref = reference.HFReference(path, layers)
    rows = []
    for k, r in enumerate(res):
        ids = r["input_ids"].tolist()
        owner = next((i for i, p in enumerate(prompts) if p == ids), None)
        dtype = str(r["hidden_states"][0].dtype).replace("torch.", "")
        worst, bad = reference.compare([r["hidden_states"]], [ids], ref, reference.TOLERANCE[dtype])
        rows.append({"row": k, "belongs_to": owner, "len": len(ids), "states_match_hf": not bad, "worst": worst})
        out["dtype"] = dtype
    out["rows"] = len(res)
    out["in_input_order"] = [r["belongs_to"] for r in rows] == list(range(len(prompts)))
    out["order"] = [r["belongs_to"] for r in rows]
    out["rows_matching_hf"] = sum(r["states_match_hf"] for r in rows)
    out["worst_by_row"] = [
        round(float(r["worst"]), 4) if isinstance(r["worst"], float) else str(r["worst"])[:60] for r in rows
    ]
    out["loss_mask"] = repr(res[0].get("loss_mask"))[:40]
    # a second call on the same engine, the prompts reversed
    again = gen.generate(prompts[::-1])
    back = [next((i for i, p in enumerate(prompts) if p == r["input_ids"].tolist()), None) for r in again]
    _, bad2 = reference.compare(
        [r["hidden_states"] for r in again], [r["input_ids"].tolist() for r in again], ref, reference.TOLERANCE[dtype]
    )
    out["second_call"] = {
        "in_input_order": back == list(range(len(prompts)))[::-1],
        "rows_matching_hf": len(again) - len({b.seq for b in bad2}),
    }
    print("PROBE " + json.dumps(out))


if __name__ == "__main__":
    main()

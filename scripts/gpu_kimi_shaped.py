#!/usr/bin/env python3
"""Kimi-K2.5-shaped extraction on ONE GPU (issue: multi-GPU run; the single-H200 part).

Builds, on the GPU, a random-weight DeepSeek-V3-architecture model at Kimi-K2.5's width (hidden 7168,
MLA q_lora 1536 / kv_lora 512 / 64 heads / qk_nope 128 / qk_rope 64 / v 128, vocab 163840, top-8
routing with one shared expert) but few layers and experts (default 3 layers: 1 dense + 2 MoE, 16
experts) in bf16 (no INT4 tooling on that machine), then runs the drop-in generator at TP=1 and
compares every captured layer with HF transformers (float32, same GPU).
    python scripts/gpu_kimi_shaped.py OUTDIR [--layers 3] [--experts 16] [--width 7168]
"""
import argparse
import json
import os
import sys
import time


def build(path, layers, experts, width, vocab):
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(vocab_size=vocab, hidden_size=width, intermediate_size=int(width * 18432 / 7168),
              moe_intermediate_size=int(width * 2048 / 7168), num_hidden_layers=layers, num_attention_heads=64,
              num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=experts, num_experts_per_tok=8,
              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
              norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", max_position_embeddings=8192,
              rope_theta=50000.0, rope_scaling=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              initializer_range=0.02)
    cfg = DeepseekV3Config(**kw)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20GB")
    from speculators_compat.testing.models import save_tokenizer

    save_tokenizer(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--width", type=int, default=7168)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--build-only", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = {"layers": a.layers, "experts": a.experts, "width": a.width}
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kimi-shaped-{a.layers}l-{a.experts}e-{a.width}")
    t = time.time()
    if not os.path.exists(os.path.join(path, "config.json")):
        report["params"] = build(path, a.layers, a.experts, a.width, a.vocab)
    report["build_s"] = round(time.time() - t, 1)
    print(json.dumps(report), flush=True)
    if a.build_only:
        return 0
    import speculators_compat  # noqa: F401
    import torch

    from speculators_compat import VllmHiddenStatesGenerator
    from speculators_compat.testing import models, reference

    layer_ids = list(range(a.layers))
    prompts = [[t % a.vocab for t in p] for p in models.random_prompts([5, 700, 37, 1500, 120, 64], seed=1,
                                                                          vocab=a.vocab)]
    t = time.time()
    with VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=4096, dtype="bfloat16",
                                   gpu_memory_utilization=0.5, max_num_batched_tokens=1024) as g:
        report["engine_start_s"] = round(time.time() - t, 1)
        report["model_class"] = g.engine.model_info
        g.generate(prompts)  # warm-up (MoE kernels compile on first use)
        t = time.time()
        res = g.generate(prompts)
        report["generate_s"] = round(time.time() - t, 3)
        report["tokens"] = sum(map(len, prompts))
    ref = reference.HFReference(path, layer_ids, device="cuda")
    worst, bad = reference.compare([r["hidden_states"] for r in res], prompts, ref, reference.TOLERANCE["bfloat16"])
    per_layer = {}
    for r, p in zip(res, prompts):
        for j, lid in enumerate(layer_ids):
            w = ref(p)[j]
            e = float((r["hidden_states"][j].float().cpu() - w).norm() / w.norm())
            per_layer[lid] = max(per_layer.get(lid, 0.0), e)
    report.update({"worst_rel": worst, "per_layer_worst_rel": per_layer, "mismatches": len(bad),
                   "order_ok": all(r["input_ids"].tolist() == p for r, p in zip(res, prompts)),
                   "gpu": torch.cuda.get_device_name(0)})
    print(json.dumps(report, default=str), flush=True)
    with open(os.path.join(a.out, "kimi_shaped.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

"""A model's sizes from its config.json alone (part of ``plan``): parameters per architecture family
and how the checkpoint quantizes them, weights per GPU under tensor parallelism, and KV-cache bytes
per token (plan.py's module docstring has the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def text_config(cfg: dict) -> dict:
    t = cfg.get("text_config")
    if isinstance(t, dict) and t.get("num_hidden_layers"):
        return t
    return cfg


@dataclass(frozen=True)
class Quant:
    """A checkpoint's weight quantization as the plan counts it: bits per quantized weight (scales
    included; 0: none) and which parameter groups it covers: ``experts`` (int-N checkpoints of MoE
    models, Kimi-K2.x: the routed experts only; attention, shared experts, the dense layers,
    embeddings and the ViT stay bf16, their ignore list) or ``linear`` (block-FP8 checkpoints,
    DeepSeek-V3 / Kimi-K2: every linear layer; embeddings, lm_head, norms and routers stay bf16)."""

    bits: float = 0.0
    scope: str = "experts"

    def bytes_of(self, name: str, count: int, routed: bool, dtype_bytes: int) -> float:
        linear = name.startswith(("attention", "dense MLP", "shared experts", "MLP")) or routed
        covered = bool(self.bits) and (routed if self.scope == "experts" else linear)
        return count * (self.bits / 8.0 if covered else dtype_bytes)


def quantization_of(cfg: dict) -> tuple[Quant, str]:
    """(how the checkpoint's weights are quantized, a description)."""
    q = cfg.get("quantization_config") or text_config(cfg).get("quantization_config")
    if not q:
        return Quant(), "none"
    if q.get("quant_method") == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        eff = 8 + 32.0 / (block[0] * block[1])  # e4m3 weights, one float32 scale per block
        return Quant(eff, "linear"), f"fp8 blocks {block[0]}x{block[1]} ({eff:.3f} bits/weight, every linear layer)"
    if q.get("quant_method") == "compressed-tensors":
        groups = q.get("config_groups") or {}
        w = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
        bits = int(w.get("num_bits", 16))
        gs = w.get("group_size") or 0
        eff = bits + (16.0 / gs if gs else 0.0)  # one bf16 scale per group
        if w.get("symmetric") is False and gs:
            eff += bits / gs  # zero points
        return Quant(eff), f"compressed-tensors int{bits} group {gs} ({eff:.2f} bits/weight)"
    return Quant(), f"{q.get('quant_method')} (not modelled: counted as bf16)"


def count_params(cfg: dict) -> dict[str, Any]:
    """Parameter groups: list of (name, count, per-layer-kind, sharded_by_tp, quantizable)."""
    t = text_config(cfg)
    h = t["hidden_size"]
    n = t["num_hidden_layers"]
    vocab = t["vocab_size"]
    groups: list[tuple[str, int, bool, bool]] = []  # (name, params, tp_sharded, is_routed_expert)
    tied = bool(t.get("tie_word_embeddings", False))
    groups.append(("embed_tokens", vocab * h, True, False))
    if not tied:
        groups.append(("lm_head", vocab * h, True, False))
    is_mla = t.get("kv_lora_rank") is not None
    if is_mla:
        heads = t["num_attention_heads"]
        qk_nope, qk_rope, v_head = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
        q_lora, kv_lora = t.get("q_lora_rank"), t["kv_lora_rank"]
        qk = qk_nope + qk_rope
        if q_lora:
            q_rep = h * q_lora + q_lora  # q_a_proj + q_a_layernorm (replicated)
            q_sh = q_lora * heads * qk  # q_b_proj (column parallel)
        else:
            q_rep, q_sh = 0, h * heads * qk
        kv_rep = h * (kv_lora + qk_rope) + kv_lora  # kv_a_proj_with_mqa + kv_a_layernorm (replicated)
        kv_sh = kv_lora * heads * (qk_nope + v_head)  # kv_b_proj
        o_sh = heads * v_head * h
        groups.append(("attention (replicated)", n * (q_rep + kv_rep), False, False))
        groups.append(("attention (sharded)", n * (q_sh + kv_sh + o_sh), True, False))
    else:
        heads = t["num_attention_heads"]
        kv_heads = t.get("num_key_value_heads", heads)
        hd = t.get("head_dim") or h // heads
        attn = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
        if t.get("attention_bias") or t.get("model_type") == "qwen2":
            attn += heads * hd + 2 * kv_heads * hd
        groups.append(("attention", n * attn, True, False))
    groups.append(("norms", n * 2 * h + h, False, False))
    experts = t.get("n_routed_experts") or t.get("num_experts")
    if experts:
        dense_layers = t.get("first_k_dense_replace", 0)
        moe_layers = n - dense_layers
        inter = t["intermediate_size"]
        moe_inter = t["moe_intermediate_size"]
        shared = t.get("n_shared_experts") or 0
        groups.append(("dense MLP (first layers)", dense_layers * 3 * h * inter, True, False))
        groups.append(("routed experts", moe_layers * experts * 3 * h * moe_inter, True, True))
        groups.append(("shared experts", moe_layers * shared * 3 * h * moe_inter, True, False))
        groups.append(("routers", moe_layers * (experts * h + experts), False, False))
    else:
        groups.append(("MLP", n * 3 * h * t["intermediate_size"], True, False))
    v = cfg.get("vision_config")
    if isinstance(v, dict):
        vh = v.get("hidden_size") or v.get("vt_hidden_size") or v.get("embed_dim")
        vl = v.get("num_hidden_layers") or v.get("vt_num_hidden_layers") or v.get("depth")
        vi = v.get("intermediate_size") or v.get("vt_intermediate_size") or (4 * vh if vh else None)
        if vh and vl and vi:
            groups.append(("vision tower (estimate)", vl * (4 * vh * vh + 2 * vh * vi), False, False))
    return {"groups": groups, "is_mla": is_mla, "hidden": h, "layers": n}


def weight_bytes(info: dict, qz: Quant, dtype_bytes: int, tp: int) -> tuple[int, int, float, float]:
    """(parameters, of which quantized, weight bytes in all, weight bytes per GPU)."""
    total = quant = 0
    wbytes_total = wbytes_gpu = 0.0
    for name, count, sharded, routed in info["groups"]:
        b = qz.bytes_of(name, count, routed, dtype_bytes)
        total += count
        quant += count if b != count * dtype_bytes else 0
        wbytes_total += b
        wbytes_gpu += b / tp if sharded else b
    return total, quant, wbytes_total, wbytes_gpu


def group_layers(name: str, n: int, dense: int) -> tuple[int, int] | str:
    """Which decoder layers a parameter group of ``count_params`` spreads over, or where it sits
    whole: "first" (embeddings, the vision tower: stage 0), "last" (lm_head: the last stage)."""
    if name in ("embed_tokens",) or name.startswith("vision tower"):
        return "first"
    if name == "lm_head":
        return "last"
    if name.startswith("dense MLP"):
        return (0, dense)
    if name in ("routed experts", "shared experts", "routers"):
        return (dense, n)
    return (0, n)


def kv_bytes_per_token(t: dict, info: dict, tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes per token per GPU."""
    h, n = info["hidden"], info["layers"]
    if info["is_mla"]:
        return (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * n * dtype_bytes  # latent, replicated per rank
    heads = t["num_attention_heads"]
    kvh = t.get("num_key_value_heads", heads)
    hd = t.get("head_dim") or h // heads
    kvh_gpu = max(1, kvh // tp) if kvh >= tp else 1
    return 2 * kvh_gpu * hd * n * dtype_bytes

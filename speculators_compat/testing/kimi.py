"""Kimi-K2.5-layout checkpoints built from a DeepSeek-V3 text model (no hub needed).

Kimi-K2.5 ships as ``KimiK25ForConditionalGeneration`` (``model_type: kimi_k25``): a MoonViT vision
tower and projector around a DeepSeek-V3 language model, whose routed-expert weights are INT4
(compressed-tensors ``pack-quantized``, symmetric, group size 32); attention, the shared expert and
the dense first layer stay bf16. :func:`wrap` rewrites a DeepSeek-V3 checkpoint into that layout:

* ``config.json``: ``architectures = [KimiK25ForConditionalGeneration]``, the text model's config
  under ``text_config``, a small ``vision_config`` with the fields vLLM 0.20's KimiK25VisionConfig
  reads, and with ``int4_group`` a ``quantization_config`` in ``text_config`` (vLLM's Kimi-K2.5
  config class lifts it from there);
* ``preprocessor_config.json`` and a stand-in image processor as local code (the engine loads the
  processor while it reads the config, as it does the hub's remote one; so ``trust_remote_code``);
* weights: every text tensor under ``language_model.`` (``language_model.model.layers.N...``,
  ``language_model.lm_head.weight``) plus a few ``vision_tower.*`` / ``mm_projector.*`` tensors, as
  a real checkpoint has (extraction reads text only: the engine must not need them);
* with ``int4_group``: each routed expert's ``gate_proj``/``up_proj``/``down_proj`` becomes
  ``weight_packed`` (int32, eight 4-bit values a word, lowest nibble first, stored as value + 8),
  ``weight_scale`` ([out, in / group], the text model's dtype) and ``weight_shape`` ([out, in]).
  The dequantized weights (``q * scale``) are written as a plain DeepSeek-V3 checkpoint to
  ``ref_dir``: that is the model the engine actually runs, so it is the HF reference.

The vision tower is a stand-in (random tensors under its prefix), so these checkpoints are for
text-only extraction, which is all the generator does.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

#: a routed expert's projection, in HF DeepSeek-V3 names (shared experts are ``shared_experts``)
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")

#: what stays unquantized (the parts Kimi-K2.5 keeps in bf16; the list's exact form is ours): the
#: head, attention, the shared expert, the dense layers' MLP (``mlp.gate_proj``, not
#: ``mlp.experts.E.gate_proj``)
IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]

VISION = dict(
    patch_size=14,
    init_pos_emb_height=8,
    init_pos_emb_width=8,
    init_pos_emb_time=4,
    pos_emb_type="divided_fixed",
    num_attention_heads=2,
    num_hidden_layers=1,
    hidden_size=64,
    intermediate_size=128,
    merge_kernel_size=[2, 2],
    video_attn_type="spatial_temporal",
    merge_type="sd2_tpool",
    mm_projector_type="patchmerger",
    projector_hidden_act="gelu",
    projector_ln_eps=1e-5,
)


#: preprocessor_config.json: the hub checkpoint's media settings, its processor class as local code
MEDIA = dict(
    patch_size=14,
    merge_kernel_size=[2, 2],
    in_patch_limit=16384,
    patch_limit_on_one_side=512,
    fixed_output_tokens=None,
    in_patch_limit_each_frame=4096,
    temporal_merge_kernel_size=4,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
PROCESSOR_MODULE = "kimi_k25_vision_processing"
PROCESSOR_CODE = '''"""Stand-in for Kimi-K2.5's remote image processor (speculators-compat tiny checkpoint).

The engine builds it while reading the config; text-only extraction never calls it."""
from transformers.image_processing_utils import BaseImageProcessor


class TinyKimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values"]

    def __init__(self, media_proc_cfg=None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})

    def media_tokens_calculator(self, media):
        raise NotImplementedError("tiny Kimi-K2.5 checkpoint: its vision processor is a stand-in")
'''


def quantization_config(group: int) -> dict:
    """compressed-tensors config for symmetric INT4 weights with group scales on every Linear not ignored."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
            }
        },
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
    }


def quantize_int4(w, group: int):
    """(q int8 in [-8, 7], scale [out, in / group] in w's dtype, dequantized weight in w's dtype).

    The scale is max|w| / 7 per group, rounded to w's dtype first, so ``q * scale`` is exactly what
    an engine dequantizing the stored values gets (up to the product's own rounding)."""
    import torch

    out, inp = w.shape
    if inp % group:
        raise ValueError(f"input size {inp} is not a multiple of the group size {group}")
    g = w.float().reshape(out, inp // group, group)
    scale = (g.abs().amax(dim=-1) / 7.0).clamp_min(1e-8).to(w.dtype)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7)
    deq = (q * scale.float().unsqueeze(-1)).reshape(out, inp).to(w.dtype)
    return q.reshape(out, inp).to(torch.int8), scale, deq


def pack_int4(q):
    """int8 values in [-8, 7], [out, in] -> int32 [out, in / 8]: column j's value + 8 goes to nibble
    j % 8 (lowest first) of word j // 8."""
    import torch

    out, inp = q.shape
    if inp % 8:
        raise ValueError(f"input size {inp} is not a multiple of 8")
    u = (q.to(torch.int32) + 8).reshape(out, inp // 8, 8)
    packed = torch.zeros(out, inp // 8, dtype=torch.int32, device=q.device)
    for i in range(8):
        packed |= u[:, :, i] << (4 * i)  # nibble 7 sets the sign bit: int32 wraps, as stored
    return packed


def unpack_int4(packed, inp: int):
    """Inverse of :func:`pack_int4`."""
    import torch

    cols = [((packed >> (4 * i)) & 0xF) for i in range(8)]
    return (torch.stack(cols, dim=-1).reshape(packed.shape[0], -1)[:, :inp] - 8).to(torch.int8)


def wrap(text_dir, out_dir, *, int4_group: int | None = None, ref_dir=None) -> Path:
    """Write ``text_dir`` (an HF DeepSeek-V3 checkpoint) as a Kimi-K2.5 checkpoint into ``out_dir``."""
    import torch
    from safetensors.torch import load_file, save_file

    text_dir, out_dir = Path(text_dir), Path(out_dir)
    if int4_group and ref_dir is None:
        raise ValueError("int4_group needs ref_dir: the dequantized checkpoint is the HF reference")
    text_cfg = json.loads((text_dir / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict = {}
    for f in sorted(text_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    dtype = next(iter(tensors.values())).dtype
    out, ref = {}, {}
    for name, t in tensors.items():
        if int4_group and EXPERT.match(name):
            q, scale, deq = quantize_int4(t, int4_group)
            stem = "language_model." + name.removesuffix(".weight")
            out[stem + ".weight_packed"] = pack_int4(q)
            out[stem + ".weight_scale"] = scale.contiguous()
            out[stem + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            ref[name] = deq
        else:
            out["language_model." + name] = t.contiguous()
            ref[name] = t
    gen = torch.Generator().manual_seed(7)
    for name, shape in (
        ("vision_tower.patch_embed.proj.weight", (64, 3, 14, 14)),
        ("vision_tower.patch_embed.proj.bias", (64,)),
        ("mm_projector.proj.0.weight", (256, 256)),
        ("mm_projector.proj.2.weight", (text_cfg["hidden_size"], 256)),
    ):
        out[name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tc = {k: v for k, v in text_cfg.items() if k not in ("architectures", "auto_map", "transformers_version")}
    tc["model_type"] = "deepseek_v3"
    if int4_group:
        tc["quantization_config"] = quantization_config(int4_group)
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": tc,
        "vision_config": dict(VISION),
        "tie_word_embeddings": False,
        "pad_token_id": text_cfg.get("pad_token_id", 0),
        "torch_dtype": text_cfg.get("torch_dtype"),
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    for f in text_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out_dir / f.name)
    (out_dir / f"{PROCESSOR_MODULE}.py").write_text(PROCESSOR_CODE)
    pre = {
        "auto_map": {"AutoImageProcessor": f"{PROCESSOR_MODULE}.TinyKimiK25VisionProcessor"},
        "image_processor_type": "TinyKimiK25VisionProcessor",
        "media_proc_cfg": dict(MEDIA),
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(pre, indent=1) + "\n")
    if int4_group:
        ref_dir = Path(ref_dir)
        ref_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in ref.items()}, str(ref_dir / "model.safetensors"), metadata={"format": "pt"}
        )
        for f in text_dir.iterdir():
            if f.suffix != ".safetensors" and f.is_file() and f.name != "model.safetensors.index.json":
                shutil.copy2(f, ref_dir / f.name)
    return out_dir

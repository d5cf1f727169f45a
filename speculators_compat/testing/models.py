"""Tiny random-weight models and tokenizers, built locally and deterministically (no hub).

``build("llama")`` returns a directory with config.json, model.safetensors and a tokenizer, under
``$SPECULATORS_COMPAT_CACHE/models`` (default ``~/.cache/speculators-compat/models``), built once
and reused. Head size 32 (vLLM's CPU attention rejects 16).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .. import envs

VOCAB = 1024
CACHE = Path(os.path.expanduser(envs.get("SPECULATORS_COMPAT_CACHE")))
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    initializer_range=0.1,
)

SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, rope_theta=10000.0)),
    # DeepSeek-V3 architecture (MLA + MoE), the one Kimi-K2 checkpoints declare.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            # vLLM MLA needs kv_lora_rank + qk_rope_head_dim in {320, 512, 576} (Kimi-K2.5: 512 + 64)
            q_lora_rank=64,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=64,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            rope_theta=10000.0,
            rope_scaling=None,
        ),
    ),
}
# A ~100M-parameter Llama for CPU benchmarks (8 layers, hidden 1024).
SPECS["llama-100m"] = (
    "LlamaConfig",
    "LlamaForCausalLM",
    dict(
        _COMMON,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        rope_theta=10000.0,
        initializer_range=0.02,
    ),
)
# A ~1.1B-parameter Llama-shaped model for the GPU run, saved in bf16 (16 layers, hidden 2048), with
# 16,384 positions for the long-prompt cases (--seq 8192).
SPECS["llama-1b"] = (
    "LlamaConfig",
    "LlamaForCausalLM",
    dict(
        _COMMON,
        max_position_embeddings=16384,
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=10000.0,
        initializer_range=0.02,
        torch_dtype="bfloat16",
    ),
)


# A Llama with a byte-level BPE tokenizer that round-trips text and a ChatML chat template: for the
# chat, render and regeneration steps of speculators >= 0.5's pipeline (the word-level tokenizer of
# the others maps most text to <unk>).
CHAT_VOCAB = 512
SPECS["llama-chat"] = ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, vocab_size=CHAT_VOCAB, rope_theta=10000.0))
CHAT_SPECIAL = ["<unk>", "<s>", "<|im_end|>", "<pad>", "<|im_start|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: checkpoints made from another tiny model: name -> (source model, what is done to it)
DERIVED = {
    # the source's DeepSeek-V3 text model inside Kimi-K2.5's multimodal wrapper (testing/kimi.py)
    "kimi_k25": ("deepseek_v3", "kimi-k25-wrapper-v2"),
}


def _key(name: str) -> str:
    import transformers

    if name in DERIVED:
        src, how = DERIVED[name]
        return f"{name}-{how}-{_key(src)}"

    major = transformers.__version__.split(".")[0]
    spec = json.dumps(SPECS[name], sort_keys=True, default=str)
    return f"{name}-tf{major}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"


def build(name: str, root: Path | None = None) -> Path:
    """Path of the tiny model ``name`` (llama, qwen2, deepseek_v3, kimi_k25, llama-100m), building it once."""
    if name not in SPECS and name not in DERIVED:
        raise KeyError(f"unknown tiny model {name!r}; choose from {sorted([*SPECS, *DERIVED])}")
    root = Path(root or CACHE / "models")
    out = root / _key(name)
    if (out / ".complete").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _build_into(name, tmp)
        (tmp / ".complete").write_text("ok\n")
        if out.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def reference_path(name: str) -> Path:
    """The checkpoint HF transformers runs as ``name``'s reference (a wrapper's text model)."""
    return build(DERIVED[name][0]) if name in DERIVED else build(name)


def _build_into(name: str, d: Path) -> None:
    import torch
    import transformers

    if name == "kimi_k25":
        from . import kimi

        kimi.wrap(build(DERIVED[name][0]), d)
        return

    cfg_cls, model_cls, kw = SPECS[name]
    kw = dict(kw)
    save_dtype = getattr(torch, kw.pop("torch_dtype", "float32"))
    std = 0.1 if kw.get("initializer_range", 0.1) >= 0.1 else kw["initializer_range"]
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(4321)
        for pname, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in pname or "layernorm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.zero_()
    model = model.to(save_dtype)
    model.config.torch_dtype = save_dtype
    model.save_pretrained(d, safe_serialization=True)
    save_chat_tokenizer(d) if name == "llama-chat" else save_tokenizer(d)


def save_tokenizer(d: Path) -> None:
    """A word-level tokenizer over ``t4``..``t1023`` plus specials (eos ``</s>`` = 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(d)


def save_chat_tokenizer(d: Path) -> None:
    """A byte-level BPE of ``CHAT_VOCAB`` ids trained on a fixed text (any text round-trips:
    unseen words fall back to bytes), eos ``<|im_end|>`` = 2, with ``CHAT_TEMPLATE``."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = (
        "the a of to and in is it you that he was for on are with as his they be at one have this from "
        "or had by hot word but what some we can out other were all there when up use your how said an "
        "each she which do their time if will way about many then them write would like so these her "
        "long make thing see him two has look more day could go come did number sound no most people"
    ).split()
    rng = random.Random(7)
    text = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + rng.choice(".?!") for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CHAT_VOCAB,
        special_tokens=CHAT_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(d)


def random_prompts(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Deterministic prompts of the given lengths, avoiding special ids."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(len(SPECIAL), vocab) for _ in range(n)] for n in lengths]

"""``--states-dtype``: the flag, what a run refuses before anything starts, and what ``plan`` prints
(bytes per token and disk for each states dtype). No torch, no engine."""

import argparse

import pytest

from speculators_compat.pipeline.options import ExtractOptions, add_extract_args, add_plan_args
from speculators_compat.pipeline.plan import disk_bytes_per_token, format_plan, make_plan, state_bytes_per_token


def test_the_flag_reaches_the_engine_settings():
    p = argparse.ArgumentParser()
    add_extract_args(p)
    a = p.parse_args(["--model", "m", "--input", "i", "--output", "o", "--states-dtype", "fp8"])
    assert ExtractOptions.from_args(a).engine["states_dtype"] == "fp8"
    assert ExtractOptions.from_args(a).states_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--input", "i", "--output", "o", "--states-dtype", "int8"])


def test_refused_before_anything_starts(tmp_path):
    opts = ExtractOptions.build(states_dtype="fp8", fmt="safetensors", shard_size=4)
    with pytest.raises(ValueError, match="--states-dtype fp8 is written one file a sample"):
        opts.check(str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="states_dtype must be one of auto, fp8, not 'fp4'"):
        ExtractOptions.build(states_dtype="fp4").check(str(tmp_path / "in.jsonl"), str(tmp_path / "out"))


def test_bytes_per_token():
    # Kimi-K2.5: 4 captured layers x 7168; Llama-3.1-8B: 4 x 4096 (docs/storage.md)
    assert state_bytes_per_token(4, 7168, 2) == 57344
    assert state_bytes_per_token(4, 7168, 2, "fp8") == 28676  # one byte a value, a float32 scale a token
    assert disk_bytes_per_token(4, 4096, 2, "fp8") == 4 * 4096 + 4 + 16


def test_plan_prints_both(tmp_path):
    import json

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kw = dict(layer_ids=[2, 16, 29, 31], num_samples=300_000, avg_tokens=2048)
    auto, f8 = make_plan(str(tmp_path), **kw), make_plan(str(tmp_path), states_dtype="fp8", **kw)
    assert auto.hidden_bytes_per_token == 4 * 4096 * 2 and f8.hidden_bytes_per_token == 4 * 4096 + 4
    assert auto.by_states_dtype == f8.by_states_dtype
    assert auto.by_states_dtype["fp8"]["disk_bytes"] == 300_000 * 2048 * (4 * 4096 + 4 + 16) + 300_000 * 1500
    text = format_plan(f8)
    assert "hidden states (fp8): 16,388 B per token" in text
    assert "by --states-dtype: auto 32,768 B/token" in text and "fp8 16,388 B/token" in text
    p = argparse.ArgumentParser()
    add_plan_args(p)
    assert p.parse_args(["--model", "m", "--states-dtype", "fp8"]).states_dtype == "fp8"

"""Pipeline stages without an engine: vLLM's split of the layers (layers.stage_ranges), the driver's
map of which stage captures what (engine/stages.py), one batch put together from every stage's reply,
the flags, what a run over several hosts refuses before vLLM starts, and plan's per-stage figures.
The real engine's split is held equal to stage_ranges in tests/engine/test_pipeline_parallel.py."""

import argparse

import pytest

from speculators_compat.engine.config import EngineOptions, check_sizes
from speculators_compat.engine.stages import StageMap, merge
from speculators_compat.layers import stage_ranges
from speculators_compat.pipeline.options import ExtractOptions, add_extract_args, add_plan_args
from speculators_compat.pipeline.plan import format_plan, make_plan


def test_stage_ranges_as_vllm_splits_them(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert stage_ranges(6, 1) == [(0, 6)]
    assert stage_ranges(6, 2) == [(0, 3), (3, 6)]
    assert stage_ranges(61, 2) == [(0, 31), (31, 61)]  # Kimi-K2.5: the remainder before the last stage
    assert stage_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]  # (vLLM: [2, 3, 3, 2])
    assert stage_ranges(6, 2, "2,4") == [(0, 2), (2, 6)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,2")
    assert stage_ranges(6, 2) == [(0, 4), (4, 6)]
    with pytest.raises(ValueError, match="needs 2 counts summing to 6 layers"):
        stage_ranges(6, 2, "3,4")
    with pytest.raises(ValueError, match="3 pipeline stages but the model has 2 decoder layers"):
        stage_ranges(2, 3, "")


def _info(stage, layers, capturing=True, handoff="shm", stages=2):
    return {
        "stage": stage,
        "stages": stages,
        "stage_layers": layers,
        "capturing": capturing,
        "handoff": handoff,
        "layer_range": [3 * stage, 3 * stage + 3],
    }


def test_stage_map_from_the_workers_replies():
    infos = [_info(0, [1]), _info(0, [1], capturing=False), _info(1, [5, 3], handoff="rpc"), {"capturing": False}]
    m = StageMap.from_infos(infos, [5, 1, 3])
    assert m.layers == {0: [1], 1: [5, 3]} and not m.single
    assert m.describe() == [
        {"stage": 0, "layers": [1], "handoff": "shm", "range": [0, 3]},
        {"stage": 1, "layers": [5, 3], "handoff": "rpc", "range": [3, 6]},
    ]
    with pytest.raises(RuntimeError, match=r"no pipeline stage captures layer\(s\) \[4\]"):
        StageMap.from_infos(infos, [1, 4])
    with pytest.raises(RuntimeError, match=r"layer\(s\) \[1\] are captured by more than one stage"):
        StageMap.from_infos([_info(0, [1]), _info(1, [1])], [1])
    assert StageMap.from_infos([_info(0, [1, 2], stages=1)], [1, 2]).single


def _reply(stage, layer_ids, states, errors=None, **kw):
    return {
        "rank_captures": True,
        "stage": stage,
        "layer_ids": layer_ids,
        "states": states,
        "errors": errors or {},
        "slabs": [f"/dev/shm/x-s{stage}-arena0"],
        "hidden": 8,
        "dtype": "float32",
        **kw,
    }


def test_a_batch_is_put_together_in_the_callers_layer_order():
    replies = [
        _reply(0, [1], {"a": ["a1"], "b": ["b1"]}),
        {"rank_captures": False, "states": {}, "errors": {}},  # a TP rank > 0
        _reply(1, [5, 3], {"a": ["a5", "a3"]}, {"b": "captured 3 of 9 prompt positions"}, self_check={"ids": [[7]]}),
    ]
    out = merge(replies, [3, 1, 5], ["a", "b"])
    assert out["states"] == {"a": ["a3", "a1", "a5"]}
    assert out["errors"] == {"b": "pipeline stage 1: captured 3 of 9 prompt positions"}
    assert out["self_check"] == {"ids": [[7]]}
    assert out["slabs"] == ["/dev/shm/x-s0-arena0", "/dev/shm/x-s1-arena0"]
    assert (out["hidden"], out["dtype"], out["fp8"]) == (8, "float32", False)
    # a last stage that captures nothing (the self-check's) adds no entries
    only = merge([_reply(0, [1, 2], {"a": ["a1", "a2"]}), _reply(1, [], {"a": []})], [2, 1], ["a"])
    assert only["states"] == {"a": ["a2", "a1"]}


def test_the_flags_reach_the_engine_settings():
    p = argparse.ArgumentParser()
    add_extract_args(p)
    args = ["--model", "m", "--input", "i", "--output", "o", "--pipeline-parallel-size", "2"]
    a = p.parse_args([*args, "--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "10.0.0.1"])
    o = ExtractOptions.from_args(a)
    assert o.engine["pipeline_parallel_size"] == 2 and o.devices_per_engine == 8
    assert (o.engine["nnodes"], o.engine["master_addr"], o.engine["distributed_executor_backend"]) == (
        2,
        "10.0.0.1",
        "mp",
    )
    with pytest.raises(SystemExit):
        p.parse_args([*args, "--distributed-executor-backend", "uni"])
    q = argparse.ArgumentParser()
    add_plan_args(q)
    assert q.parse_args(["--model", "m", "--pipeline-parallel-size", "2"]).pipeline_parallel_size == 2


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an integer >= 1, not 0"),
        (dict(distributed_executor_backend="uni"), "distributed_executor_backend must be one of mp, ray, not 'uni'"),
        (dict(nnodes=2), "needs master_addr: the address of node rank 0"),
        (dict(nnodes=2, node_rank=2, master_addr="h"), "node_rank must be in 0..nnodes-1"),
        (dict(nnodes=2, master_addr="h", distributed_executor_backend="ray"), "Ray places workers on its nodes"),
    ],
)
def test_refused_before_vllm_starts(kw, message):
    with pytest.raises(ValueError, match=message):
        check_sizes(EngineOptions(model="/nonexistent", **kw))  # (build_vllm_config's first check)


def test_plan_prints_each_stage(tmp_path):
    import json

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    one = make_plan(str(tmp_path), tensor_parallel_size=2, gpu_memory_gib=80)
    two = make_plan(str(tmp_path), tensor_parallel_size=2, pipeline_parallel_size=2, gpu_memory_gib=80)
    assert one.stages == [] and len(two.stages) == 2
    s0, s1 = two.stages
    assert (s0["layers"], s1["layers"]) == ([0, 16], [16, 32])
    assert (s0["captures"], s1["captures"]) == ([2], [16, 29, 31])  # upstream's [2, n//2, n-3, n-1]
    # every weight is on exactly one stage: the stages' shares add up to the unsplit engine's
    assert abs(s0["weight_bytes_per_gpu"] + s1["weight_bytes_per_gpu"] - one.weight_bytes_per_gpu) <= 2
    assert s0["kv_bytes_per_token_per_gpu"] * 2 == one.kv_bytes_per_token_per_gpu
    assert two.kv_cache_tokens == min(s["kv_cache_tokens"] for s in two.stages) > one.kv_cache_tokens
    text = format_plan(two)
    assert "tensor parallel 2 x pipeline parallel 2 (4 GPUs)" in text
    assert "stage 0: layers 0..15, captures [2]" in text and "stage 1: layers 16..31, captures [16, 29, 31]" in text
    final = make_plan(str(tmp_path), pipeline_parallel_size=2, gpu_memory_gib=80, layer_ids=[2, 31, 32])
    assert [s["captures"] for s in final.stages] == [[2], [31, 32]]  # (32: the final norm's, on the last stage)


def test_plan_of_deepseek_v3_fp8_over_two_nodes():
    """The multi-node recipe's model (examples/deepseek_v3_fp8: DeepSeek-V3's config, block-FP8): every
    linear layer counted at 8 bits plus a float32 scale a 128x128 block (about 671 B parameters, 673 GB);
    it does not fit one node of 80 GB GPUs at TP=8, and fits two at TP=8 x PP=2."""
    one = make_plan("examples/deepseek_v3_fp8", tensor_parallel_size=8, gpu_memory_gib=80)
    assert 670e9 < one.params_total < 672e9 and one.params_quantized / one.params_total > 0.99
    assert 670e9 < one.weight_bytes_total < 676e9
    assert one.kv_cache_tokens == 0 and any("DO NOT FIT" in n for n in one.notes)
    two = make_plan("examples/deepseek_v3_fp8", tensor_parallel_size=8, pipeline_parallel_size=2, gpu_memory_gib=80)
    assert all(s["kv_cache_tokens"] > 500_000 for s in two.stages)
    assert [s["captures"] for s in two.stages] == [[2, 30], [58, 60]]

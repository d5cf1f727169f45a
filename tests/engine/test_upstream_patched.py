"""Unmodified speculators 0.3.0 + ``import speculators_compat``: every sequence and layer matches HF.

The generator runs upstream's own settings (dtype="auto": bf16 on CPU for these float32
checkpoints, so the bf16 tolerance applies; max_num_batched_tokens = max(8192, max_model_len)).
"""

import pytest

import speculators_compat  # noqa: F401  (the user's one-line change)
from speculators_compat.testing import models, reference

LAYERS = [1, 3, 5]
TOL = reference.TOLERANCE["bfloat16"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def upstream_gen(request):
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    path = str(models.build(request.param))
    gen = VllmHiddenStatesGenerator(path, layer_ids=LAYERS, max_model_len=2048)
    yield path, gen
    gen.__del__()


def _check(gen, path, prompts, hf_ref):
    res = gen.generate(prompts)
    assert all(r["loss_mask"] is None for r in res)
    return reference.check_results(res, prompts, hf_ref(path, LAYERS), TOL)


MIXED = [5, 1000, 37, 120, 300, 17, 64, 8, 512, 50, 99, 10, 11, 200, 33, 7, 640, 25, 900, 45]


@pytest.mark.parametrize("n", [1, 3, 13, 40])
def test_batches_of_mixed_lengths(upstream_gen, hf_ref, n):
    path, gen = upstream_gen
    lengths = (MIXED * 2)[:n]
    _check(gen, path, models.random_prompts(lengths, seed=n), hf_ref)


def test_one_token_prompts(upstream_gen, hf_ref):
    """1-token prompts (a step that schedules one token of a request looks like a decode to the
    runner) among longer ones, over upstream's 8,192-token steps: the 190-token prompt gets 189
    tokens in the first step and its last one in the second, beside the last 1-token prompt."""
    path, gen = upstream_gen
    _check(gen, path, models.random_prompts([1, 2000, 1, 2000, 1, 2000, 2000, 190, 1], seed=31), hf_ref)


def test_repeated_calls_and_repeated_prompts(upstream_gen, hf_ref):
    path, gen = upstream_gen
    prompts = models.random_prompts([64, 300, 64], seed=7)
    prompts[2] = list(prompts[0])  # the same prompt twice in one batch
    _check(gen, path, prompts, hf_ref)
    _check(gen, path, prompts, hf_ref)  # and again: no prefix-cache leak between calls


def test_shared_prefix_longer_than_a_block(upstream_gen, hf_ref):
    path, gen = upstream_gen
    prefix = models.random_prompts([300], seed=11)[0]
    tails = models.random_prompts([5, 40, 77], seed=12)
    _check(gen, path, [prefix + t for t in tails] + [prefix], hf_ref)


def test_batch_larger_than_max_num_batched_tokens(upstream_gen, hf_ref):
    # 11 x 900 = 9900 > 8192: two scheduler steps, one request split by chunked prefill (0.12+),
    # and the second step's requests in the runner's order (0.11 swapped them).
    path, gen = upstream_gen
    _check(gen, path, models.random_prompts([900] * 11, seed=5), hf_ref)


def test_overlong_sequence_is_truncated_like_upstream(upstream_gen, hf_ref):
    path, gen = upstream_gen
    long = models.random_prompts([2100], seed=3)[0]
    res = gen.generate([long])
    assert res[0]["input_ids"].tolist() == long[:2047]
    worst, bad = reference.compare([res[0]["hidden_states"]], [long[:2047]], hf_ref(path, LAYERS), TOL)
    assert not bad, bad


def test_token_ids_outside_the_vocabulary_are_refused(upstream_gen, hf_ref):
    """Upstream handed token ids to vLLM unchecked (past the input processor that checks them for
    LLM.generate). An id the embedding table lacks is refused before it reaches a worker, with the
    sequence named, and the generator keeps working."""
    path, gen = upstream_gen
    good = models.random_prompts([20, 30], seed=21)
    with pytest.raises(
        ValueError,
        match=f"sequence 1 holds token id {models.VOCAB + 3}, outside the model's vocabulary of {models.VOCAB} ids",
    ):
        gen.generate([good[0], good[1] + [models.VOCAB + 3]])
    with pytest.raises(ValueError, match="sequence 0 holds a negative token id -1"):
        gen.generate([[5, -1]])
    _check(gen, path, good, hf_ref)


def test_upstream_offline_script_steps(upstream_gen, hf_ref, tmp_path):
    """What speculators 0.3.0's scripts/data_generation_offline.py does with the generator: a batch
    from a torch-formatted datasets column (a list of 1-D tensors), results that the script pairs
    with its loss masks by position (so input order is checked), then
    ``DataGenerationConfig.from_generator`` reading the generator's model_path /
    tensor_parallel_size / vllm_config / layer_ids for ``data_config.json``."""
    import json

    import torch
    from speculators.data_generation.config_generator import DataGenerationConfig

    path, gen = upstream_gen
    prompts = models.random_prompts([40, 7, 300, 12], seed=21)
    res = gen.generate([torch.tensor(p) for p in prompts])
    assert [r["input_ids"].tolist() for r in res] == prompts
    worst, bad = reference.compare([r["hidden_states"] for r in res], prompts, hf_ref(path, LAYERS), TOL)
    assert not bad, f"worst rel err {worst}; mismatches: {bad[:5]}"
    cfg = DataGenerationConfig.from_generator(
        generator=gen,
        train_data_path="local.jsonl",
        seq_length=2048,
        cache_dir=str(tmp_path),
        num_samples=len(prompts),
        max_samples=None,
        seed=0,
    )
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["model"]["target_model_path"] == path
    assert d["model"]["tensor_parallel_size"] == 1
    assert d["model"]["gpu_memory_utilization"] == 0.8  # upstream's default, kept
    assert d["model"]["hidden_size"] == 128
    assert d["hidden_states"]["layer_ids"] == LAYERS


def test_sizes_vllm_would_take_silently_are_refused():
    """``max_model_len=1`` started the engine only for every prompt to be cut to nothing (measured
    on 0.32: the first ``generate`` failed with "prompt 0 is empty"); now it is refused before the
    engine starts."""
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    path = str(models.build("llama"))
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 2"):
        VllmHiddenStatesGenerator(path, layer_ids=LAYERS, max_model_len=1)

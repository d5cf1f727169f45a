"""Unmodified speculators 0.3.0 + ``import speculators_compat``: the cases that start an engine of
their own, kept apart from test_upstream_patched.py's module-wide engines (one engine at a time).
"""

import pytest

import speculators_compat  # noqa: F401  (the user's one-line change)
from speculators_compat.testing import models, reference
from tests.helpers import check_generate

LAYERS = [1, 3, 5]
TOL = reference.TOLERANCE["bfloat16"]


def _check(gen, path, prompts, hf_ref):  # input order, every layer vs HF (bf16)
    res = check_generate(gen, path, prompts, hf_ref, LAYERS, TOL)
    assert all(r["loss_mask"] is None for r in res)


@pytest.mark.slow
def test_upstream_tensor_parallel_2(llama_path, hf_ref, monkeypatch):
    """The user's unchanged script with ``tensor_parallel_size=2`` (the flagship job runs TP=8): two
    CPU workers, one core each. 11 x 900 tokens exceed upstream's 8,192-token step, so the batch
    spans two scheduler steps with one prompt split by chunked prefill; then a second call. Every
    row of every layer is compared with HF (bf16: upstream's dtype="auto"), in input order."""
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    gen = VllmHiddenStatesGenerator(llama_path, layer_ids=LAYERS, max_model_len=1024, tensor_parallel_size=2)
    try:
        assert gen.vllm_config.parallel_config.tensor_parallel_size == 2
        _check(gen, llama_path, models.random_prompts([900] * 11, seed=43), hf_ref)
        _check(gen, llama_path, models.random_prompts([5, 400, 37, 700, 12, 90, 8, 50, 99, 10, 11, 3], seed=44), hf_ref)
    finally:
        gen.__del__()

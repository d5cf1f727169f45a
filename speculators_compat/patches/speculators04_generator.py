"""speculators 0.4.x ``VllmHiddenStatesGenerator``: delegate to our engine loop, as for 0.3.0.

0.4.x still builds the scheduler, KV cache and executor by hand, and adds two breaks of its own:
  * its results are assembled by ``sorted()`` over request ids ``req_{call}_{i}``, a string sort:
    a batch of more than 10 comes back as inputs ``[0, 1, 10, 11, ..., 2, 3, ...]``. Its own
    offline script pairs ``results[j]`` with ``loss_mask[j]`` and names the file by position, so
    every batch over 10 writes loss masks (and lengths cut from them) of other samples, silently;
  * it asks CUDA (or an NPU) for free memory at start, so it cannot start on a CPU vLLM, and from
    vLLM 0.17 its hand-built engine stops before the first step (docs/speculators-releases.md has each
    version's first failure, from tests/engine/test_speculators_releases.py).
With this patch its constructor, ``_create_vllm_config``, ``generate`` and ``__del__`` run our
engine loop and keep its contract: the same arguments (``max_num_batched_tokens`` included, default
``max(8192, max_model_len)``) and validation messages, ``generate`` returning one dict
``input_ids``/``hidden_states``/``loss_mask=None`` per input **in input order** (what its code
comments and its script expect), prompts cut to ``max_model_len - 1``, layers ascending with
duplicates collapsed, and ``vllm_config``/``executor``/``scheduler``/``tokenizer`` attributes
(its ``DataGenerationConfig.from_generator`` reads them).
"""

from __future__ import annotations

from .speculators_generator import GeneratorPatch, generate, shutdown, start_engine, upstream_options


def _init(
    self,
    model_path,
    layer_ids=None,
    max_model_len=2048,
    gpu_memory_utilization=0.8,
    tensor_parallel_size=1,
    max_num_batched_tokens=None,
    *,
    pipeline_parallel_size=1,
    distributed_executor_backend="mp",
):
    """Upstream's signature, and ours as in speculators_generator._init."""
    start_engine(
        self,
        model_path,
        layer_ids,
        max_model_len,
        gpu_memory_utilization,
        tensor_parallel_size,
        max_num_batched_tokens,
        pipeline_parallel_size=pipeline_parallel_size,
        distributed_executor_backend=distributed_executor_backend,
    )


def _create_vllm_config(
    self, model_path, max_model_len, gpu_memory_utilization, tensor_parallel_size, max_num_batched_tokens=None
):
    from ..engine.config import build_vllm_config

    return build_vllm_config(
        upstream_options(
            model_path, max_model_len, gpu_memory_utilization, tensor_parallel_size, max_num_batched_tokens
        )
    )


_REPLACEMENTS = {
    "__init__": _init,
    "_create_vllm_config": _create_vllm_config,
    "generate": generate,
    "__del__": shutdown,
}


class Speculators04GeneratorPatch(GeneratorPatch):
    name = "speculators04_generator"
    replacements = _REPLACEMENTS
    versions = ">=0.4,<0.5"
    risk = (
        "low on the speculators side (0.4.0 and 0.4.0.1 share this class); every vLLM internal it "
        "needs is reached through speculators_compat.engine"
    )
    description = (
        "upstream returns batches over 10 out of input order (string-sorted request ids), needs "
        "CUDA free memory at start and stops from vLLM 0.17: run our engine loop"
    )
    test = (
        "tests/engine/test_speculators_releases.py (unpatched per version: out of order / fails; "
        "patched: input order, HF-exact, its offline script's files and sample_lengths.json)"
    )
    why = "upstream returns batches over 10 out of input order and drives the engine by hand"

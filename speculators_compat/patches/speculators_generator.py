"""speculators 0.3.0 ``VllmHiddenStatesGenerator``: delegate to our engine loop.

Upstream builds SchedulerConfig/CacheConfig/KV cache/Scheduler by hand and slices captured rows
by offset. On vLLM 0.12+ that crashes on one changed internal after another (SchedulerConfig's new
required field first; tests/engine/test_baseline_upstream.py records each version), and even on 0.11 a
batch spanning two scheduler steps comes back with states swapped between requests. Fixing each
call site would keep the offset slicing; instead the class's ``__init__``, ``_create_vllm_config``,
``generate`` and ``__del__`` run our engine loop, which keeps upstream's contract:
  * same constructor arguments and validation messages; ``trust_remote_code=True``, ``dtype="auto"``,
    ``max_num_seqs=32``, ``max_num_batched_tokens=max(8192, max_model_len)`` as upstream;
  * ``generate`` returns input-order dicts ``input_ids``/``hidden_states``/``loss_mask=None``,
    truncating to ``max_model_len - 1`` as upstream;
  * ``hidden_states`` in ascending layer order with duplicates collapsed (upstream captured in
    forward order through a frozenset);
  * ``self.vllm_config``, ``self.executor``, ``self.scheduler`` and ``self.tokenizer`` exist.
"""

from __future__ import annotations

import logging

from .. import versions
from ..registry import Patch

logger = logging.getLogger("speculators_compat")


def _init(
    self,
    model_path,
    layer_ids=None,
    max_model_len=2048,
    gpu_memory_utilization=0.8,
    tensor_parallel_size=1,
    *,
    pipeline_parallel_size=1,
    distributed_executor_backend="mp",
):
    """Upstream's signature; ``pipeline_parallel_size`` and ``distributed_executor_backend`` (``"ray"``
    across nodes) are ours: each pipeline stage captures the layers it computes."""
    parallel = dict(
        pipeline_parallel_size=pipeline_parallel_size, distributed_executor_backend=distributed_executor_backend
    )
    start_engine(self, model_path, layer_ids, max_model_len, gpu_memory_utilization, tensor_parallel_size, **parallel)


def start_engine(
    self,
    model_path,
    layer_ids,
    max_model_len,
    gpu_memory_utilization,
    tensor_parallel_size,
    max_num_batched_tokens=None,
    **parallel,
):
    """Upstream's constructor (attributes, layer validation and its messages) over our engine."""
    from transformers import AutoTokenizer

    from ..engine.core import ExtractionEngine
    from ..layers import default_layer_ids, read_num_layers

    self.model_path = model_path
    self.tensor_parallel_size = tensor_parallel_size
    self._request_counter = 0
    self.tokenizer = AutoTokenizer.from_pretrained(model_path)
    num_layers = read_num_layers(model_path, trust_remote_code=True)
    self.layer_ids = default_layer_ids(num_layers) if layer_ids is None else layer_ids
    for layer_id in self.layer_ids:
        if layer_id < 0 or layer_id >= num_layers:
            raise ValueError(f"Layer index {layer_id} out of bounds [0, {num_layers - 1}]")
    opts = upstream_options(
        model_path, max_model_len, gpu_memory_utilization, tensor_parallel_size, max_num_batched_tokens, **parallel
    )
    self._compat_capture_ids = sorted(set(self.layer_ids))
    self._compat_engine = ExtractionEngine(opts, self._compat_capture_ids)
    self.vllm_config = self._compat_engine.vllm_config
    self.executor = self._compat_engine.executor
    self.scheduler = self._compat_engine.scheduler


def upstream_options(
    model_path, max_model_len, gpu_memory_utilization, tensor_parallel_size, max_num_batched_tokens=None, **parallel
):
    """Upstream's engine settings (0.4.x lets the caller set ``max_num_batched_tokens``); ``parallel``:
    ``pipeline_parallel_size`` / ``distributed_executor_backend``, ours."""
    from ..engine.config import UPSTREAM_MAX_NUM_SEQS, UPSTREAM_MIN_BATCHED_TOKENS, EngineOptions

    return EngineOptions(
        model=model_path,
        tokenizer=model_path,
        trust_remote_code=True,
        dtype="auto",
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=UPSTREAM_MAX_NUM_SEQS,
        max_num_batched_tokens=max_num_batched_tokens or max(UPSTREAM_MIN_BATCHED_TOKENS, max_model_len),
        **parallel,
    )


def _create_vllm_config(self, model_path, max_model_len, gpu_memory_utilization, tensor_parallel_size):
    from ..engine.config import build_vllm_config

    return build_vllm_config(upstream_options(model_path, max_model_len, gpu_memory_utilization, tensor_parallel_size))


def generate(self, token_ids):
    """Upstream's ``generate`` contract, rows in input order."""
    import torch

    if isinstance(token_ids, torch.Tensor):
        input_ids_list = token_ids.tolist()
    else:
        if not token_ids:
            raise ValueError("token_ids cannot be empty")
        input_ids_list = [ids.tolist() if isinstance(ids, torch.Tensor) else list(ids) for ids in token_ids]
    max_len = self.vllm_config.model_config.max_model_len - 1
    long = [i for i, ids in enumerate(input_ids_list) if len(ids) > max_len]
    if long:
        logger.warning(
            "speculators_compat: truncating %d sequence(s) to max_model_len - 1 = %d tokens "
            "(upstream behaviour): indices %s",
            len(long),
            max_len,
            long[:10],
        )
    input_ids_list = [ids[:max_len] for ids in input_ids_list]
    self._request_counter += 1
    states = self._compat_engine.run(input_ids_list)
    # upstream returned layers in forward (ascending) order, duplicates collapsed
    return [
        {"input_ids": torch.as_tensor(ids, dtype=torch.long), "hidden_states": layers, "loss_mask": None}
        for ids, layers in zip(input_ids_list, states)
    ]


def shutdown(self):
    eng = self.__dict__.get("_compat_engine")
    if eng is not None:
        eng.shutdown()


_REPLACEMENTS = {
    "__init__": _init,
    "_create_vllm_config": _create_vllm_config,
    "generate": generate,
    "__del__": shutdown,
}


class GeneratorPatch(Patch):
    """Replaces methods of a speculators release's ``VllmHiddenStatesGenerator`` (``replacements``)."""

    module = "speculators.data_generation.vllm_hidden_states_generator"
    package = "speculators"
    process = "driver"
    replacements: dict = {}
    #: what ``needed`` reports for the release in range
    why = ""

    def __init_subclass__(cls, **kwargs):  # (targets: the methods replaced)
        super().__init_subclass__(**kwargs)
        cls.targets = tuple(f"{cls.module}:VllmHiddenStatesGenerator.{m}" for m in cls.replacements)

    def needed(self, module):
        cls = module.VllmHiddenStatesGenerator
        missing = [m for m in self.replacements if m not in vars(cls)]
        if missing:
            from ..registry import PatchTargetError

            raise PatchTargetError(
                f"patch {self.name}: VllmHiddenStatesGenerator of speculators "
                f"{versions.installed('speculators')} lacks {missing}"
            )
        return self.why

    def _apply(self, module):
        self.replace_methods(module.VllmHiddenStatesGenerator, self.replacements)


class SpeculatorsGeneratorPatch(GeneratorPatch):
    name = "speculators_generator"
    replacements = _REPLACEMENTS
    versions = "==0.3.0"
    risk = (
        "low on the speculators side (pinned 0.3.0); every vLLM internal it needs is reached "
        "through speculators_compat.engine (EngineArgs, EngineCore, collective_rpc)"
    )
    description = (
        "upstream drives vLLM internals by hand: crashes from 0.12 and "
        "misattributes rows of multi-step batches in every version: run our engine loop"
    )
    test = (
        "tests/engine/test_baseline_upstream.py (fails without), tests/engine/test_upstream_patched.py (correct with)"
    )
    why = "upstream's hand-driven engine loop is broken on vLLM >= 0.12 and misattributes rows"

"""What the installed vLLM is like, decided once, by probing its code (not by version ranges).

Each fact names the internal it is about; ``speculators-compat doctor --probe`` reports them. The
engine loop itself needs none of them to branch: the version-specific parts (config fields, KV-cache
set-up, block hashing, the two-phase step) are delegated to vLLM's own EngineArgs and EngineCore, and
the one behaviour the loop depends on directly (what ``collective_rpc(unique_reply_rank=0)``
returns) is probed by calling it at start-up. The patches' ``needed()`` probes use the same kind of
signature checks.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from functools import lru_cache


@dataclass(frozen=True)
class VllmFacts:
    version: str
    #: ``Request.__init__`` still takes ``eos_token_id`` (removed in 0.17).
    request_takes_eos: bool
    #: ``Request.__init__`` takes ``block_hasher`` (0.11+).
    request_takes_block_hasher: bool
    #: the executor has the second phase ``sample_tokens`` (0.12+): execute_model returns None.
    two_phase: bool
    #: EngineCore drives the two phases and the async batch queue itself (``step_fn``).
    engine_core_step_fn: bool
    #: Model Runner V2 exists (``vllm.v1.worker.gpu.model_runner``, 0.12+).
    has_v2_runner: bool
    #: the V1 runner exists (``vllm.v1.worker.gpu_model_runner``, removed in 0.34): pinned while it does.
    has_v1_runner: bool
    #: ``SchedulerConfig`` needs ``is_encoder_decoder`` (0.12+) — handled by EngineArgs for us.
    scheduler_config_needs_is_encoder_decoder: bool
    #: ``Scheduler.__init__`` takes ``block_size`` (0.12+) / ``hash_block_size`` (0.20+).
    scheduler_takes_block_size: bool
    scheduler_takes_hash_block_size: bool
    #: base models expose ``embed_input_ids`` (0.12+) instead of ``get_input_embeddings``.
    embed_input_ids: bool
    #: ``EngineArgs`` takes ``language_model_only`` (0.17+): a multimodal wrapper runs text only.
    engine_args_language_model_only: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def module_exists(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it (parents are imported by find_spec)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing; a module without __spec__
        return False


@lru_cache(maxsize=1)
def probe() -> VllmFacts:
    """Inspect the installed vLLM (imports it)."""
    import vllm
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.request import Request

    req = _params(Request.__init__)
    sched = _params(Scheduler.__init__)
    fields = getattr(SchedulerConfig, "__dataclass_fields__", {})
    try:
        from vllm.model_executor.models.llama import LlamaModel

        embed = hasattr(LlamaModel, "embed_input_ids")
    except ImportError:  # pragma: no cover
        embed = False
    return VllmFacts(
        version=str(vllm.__version__),
        request_takes_eos="eos_token_id" in req,
        request_takes_block_hasher="block_hasher" in req,
        two_phase=hasattr(Executor, "sample_tokens"),
        engine_core_step_fn="step_with_batch_queue" in dir(EngineCore),
        has_v2_runner=module_exists("vllm.v1.worker.gpu.model_runner"),
        has_v1_runner=module_exists("vllm.v1.worker.gpu_model_runner"),
        scheduler_config_needs_is_encoder_decoder="is_encoder_decoder" in fields,
        scheduler_takes_block_size="block_size" in sched,
        scheduler_takes_hash_block_size="hash_block_size" in sched,
        embed_input_ids=embed,
        engine_args_language_model_only="language_model_only" in getattr(EngineArgs, "__dataclass_fields__", {}),
    )

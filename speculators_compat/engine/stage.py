"""Where a capturing worker sits: its pipeline stage and tensor-parallel rank, the receive buffer a
later stage needs, and whether it shares the driver's /dev/shm."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """Where this worker sits: its pipeline stage (rank, size) and its rank in the stage's TP group."""

    rank: int = 0
    size: int = 1
    tp_rank: int = 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


def pipeline_stage() -> Stage:
    try:
        from vllm.distributed import get_pp_group, get_tp_group
    except ImportError:  # pragma: no cover - only outside vLLM
        return Stage()
    pp = get_pp_group()
    return Stage(pp.rank_in_group, pp.world_size, get_tp_group().rank_in_group)


def _ensure_stage_buffer(runner, model, stage: Stage) -> None:
    """A stage after the first receives the previous stage's hidden states into the V1 runner's
    ``intermediate_tensors`` buffer, which the runner makes in its warm-up forward. vLLM's CPU worker
    skips that forward when the model runs eagerly with a set KV-cache size (our engine runs eagerly),
    and the first step then fails (``assert self.intermediate_tensors is not None``, vLLM 0.32 CPU):
    make the buffer as the warm-up would (``install_capture`` runs on every worker)."""
    if stage.rank == 0 or getattr(runner, "intermediate_tensors", 0) is not None:
        return
    make = getattr(model, "make_empty_intermediate_tensors", None)
    if callable(make):
        runner.intermediate_tensors = make(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )


def shares_driver_shm(prefix: str) -> bool:
    """Does this worker see the driver's /dev/shm? The driver holds ``<prefix>lock`` there for the
    engine's life; a worker on another host (or in a container with a /dev/shm of its own) does not
    see it, and its rows travel back over vLLM's RPC instead. ``SPECULATORS_COMPAT_HANDOFF=rpc`` in
    a worker's environment (a node's) sends that worker's rows over RPC whatever it sees."""
    import os

    from .. import envs
    from .handoff import LOCK_SUFFIX

    return envs.get("SPECULATORS_COMPAT_HANDOFF") != "rpc" and os.path.exists(prefix + LOCK_SUFFIX)

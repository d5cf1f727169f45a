"""The engine's configuration: what a generator asks for (``EngineOptions``) and the VllmConfig
built from it with vLLM's own ``EngineArgs(...).create_engine_config()``, which fills every
version's required fields. Extraction needs prefix caching off (a cache hit skips computing the
cached positions, whose states would then never be captured), worker processes (the same path
at TP=1 and TP>1), the V1 model runner where vLLM still has it, and our worker extension.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .settings import FRACTION, HOSTS, SECONDS, check_all, check_value, declare, declared, int_at_least, one_of

logger = logging.getLogger("speculators_compat.engine")
WORKER_EXTENSION = "speculators_compat.engine.worker.CaptureExtension"


ASYNC_CHOICES = ("disable", "keep")
STATES_DTYPES = ("auto", "fp8")
EXECUTOR_BACKENDS = ("mp", "ray")


def resolve_async(strategy: str | None) -> str:
    """``keep`` (None: vLLM's own choice of async scheduling) or ``disable``."""
    s = "keep" if strategy is None else strategy
    if s not in ASYNC_CHOICES:
        raise ValueError(f"async_scheduling must be one of {', '.join(ASYNC_CHOICES)} or None, not {s!r}")
    return s


_MODEL_LEN = int_at_least(2, none="None for the model's own", why=" (prompts keep at most max_model_len - 1 tokens)")
_SIZE = int_at_least(1, none="None for vLLM's default")


@dataclass
class EngineOptions:
    """An engine's settings. A field declared with ``declare`` is a user's setting: the drop-in
    constructor's keyword and a flag of extract, serve, node and plan (settings.py); the others are
    set by the library."""

    model: str
    tokenizer: str | None = None
    max_model_len: int = field(
        default=2048, metadata=declare("longest prompt + 1, in tokens", parse=int, check=_MODEL_LEN)
    )
    gpu_memory_utilization: float = field(
        default=0.8, metadata=declare("share of each GPU's memory vLLM takes", parse=float, check=FRACTION)
    )
    tensor_parallel_size: int = field(
        default=1, metadata=declare("GPUs one stage's layers are split over", parse=int, check=int_at_least(1))
    )
    #: each stage's first TP rank captures the layers it computes (capture.py)
    pipeline_parallel_size: int = field(
        default=1,
        metadata=declare(
            "pipeline stages (vLLM's); each stage captures the layers it computes (docs/multi-node.md)",
            parse=int,
            check=int_at_least(1),
            serve="refuse",
            serve_note="serve captures in one pipeline stage: use --tensor-parallel-size (pipeline stages: extract)",
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=declare(
            "mp: worker processes (vLLM 0.32+: also on other hosts, --nnodes); ray: vLLM's Ray executor, "
            "workers on the nodes of the Ray cluster RAY_ADDRESS names (docs/multi-node.md)",
            choices=EXECUTOR_BACKENDS,
            check=one_of(EXECUTOR_BACKENDS),
        ),
    )
    #: hosts one engine's workers span with the multiprocessing executor (vLLM 0.32+): this host's
    #: rank among them (0: the driver's) and where rank 0 listens (node.py runs the other hosts)
    nnodes: int = field(
        default=1,
        metadata=declare(
            "hosts the engine's workers span", parse=int, check=int_at_least(1), group=HOSTS, serve="flag-if-set"
        ),
    )
    node_rank: int = 0
    master_addr: str | None = field(
        default=None, metadata=declare("the driver's host address, as the other hosts reach it", group=HOSTS)
    )
    master_port: int | None = field(
        default=None,
        metadata=declare("(default: vLLM's)", parse=int, check=int_at_least(1, none="None for vLLM's"), group=HOSTS),
    )
    liveness_timeout_s: float | None = field(
        default=None,
        metadata=declare(
            "seconds without word from another host before the run stops, naming it (default 60; the "
            "driver listens on --master-port + 1 for the hosts' beats)",
            parse=float,
            check=SECONDS,
            flag="--liveness-timeout",
            group=HOSTS,
            serve="ours",
        ),
    )  # (None: liveness.DEFAULT_TIMEOUT_S)
    dtype: str = field(default="auto", metadata=declare("the model's compute dtype (vLLM's --dtype)"))
    quantization: str | None = field(
        default=None, metadata=declare("vLLM's --quantization (default: the checkpoint's)")
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=declare(
            "run the checkpoint's own config/tokenizer code (Kimi-K2.5 needs it)", switch=True, serve="switch"
        ),
    )
    max_num_batched_tokens: int | None = field(
        default=None, metadata=declare("tokens per engine step (default: vLLM's)", parse=int, check=_SIZE)
    )
    max_num_seqs: int | None = field(
        default=None, metadata=declare("sequences per engine step (default: vLLM's)", parse=int, check=_SIZE)
    )
    enable_expert_parallel: bool = field(
        default=False, metadata=declare("MoE experts spread over the GPUs (vLLM's)", switch=True, serve="switch")
    )
    async_scheduling: str | None = field(
        default=None,
        metadata=declare(
            "keep (default): vLLM's own choice of async scheduling; disable: off",
            choices=ASYNC_CHOICES,
            check=one_of(ASYNC_CHOICES, none="None (keep)"),
            serve="no-",
        ),
    )
    seed: int = 0
    enforce_eager: bool = True
    #: "fork" | "spawn" | None (spawn on CUDA hosts: see choose_start_method; elsewhere vLLM's choice, CPU: spawn)
    worker_start_method: str | None = None
    #: hand captured rows to the caller as tensors over the /dev/shm arena (None: SPECULATORS_COMPAT_ZERO_COPY)
    zero_copy: bool | None = None
    #: check every request's sampled token against its captured state (None: SPECULATORS_COMPAT_SELF_CHECK)
    self_check: bool | None = None
    states_dtype: str = field(
        default="auto",
        metadata=declare(
            "auto: the model's dtype; fp8: e4m3 with one float32 scale per token, quantized on the "
            "device as speculators' hs-connectors fp8 backend does (half the bytes of bf16; docs/storage.md)",
            choices=STATES_DTYPES,
            check=one_of(STATES_DTYPES),
            serve="ours",
        ),
    )
    engine_kwargs: dict = field(default_factory=dict)  # passed through to EngineArgs


def check_states_dtype(name) -> str:
    check_value(next(f for f in declared(EngineOptions) if f.name == "states_dtype"), name)
    return name


def check_sizes(opts: EngineOptions) -> None:
    """Refuse values vLLM would take silently or only fail on later (each declared setting by its
    own check: ``max_num_seqs=0`` and ``max_num_batched_tokens=0`` ran as if unset on vLLM 0.32, and
    ``max_model_len=1`` started the engine only for every prompt to be cut to nothing), and the
    multi-host settings together."""
    check_all(opts)
    check_nodes(opts)


def build_vllm_config(opts: EngineOptions):
    """A VllmConfig for extraction, from vLLM's own EngineArgs (stable in every version)."""
    check_sizes(opts)  # (before vLLM is imported)
    _pin_v1_runner()
    from vllm.engine.arg_utils import EngineArgs

    from . import facts as facts_mod

    strategy = resolve_async(opts.async_scheduling)
    kw: dict[str, Any] = dict(
        model=opts.model,
        tokenizer=opts.tokenizer or opts.model,
        trust_remote_code=opts.trust_remote_code,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        enforce_eager=opts.enforce_eager,
        tensor_parallel_size=opts.tensor_parallel_size,
        pipeline_parallel_size=opts.pipeline_parallel_size,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        worker_extension_cls=WORKER_EXTENSION,
        # Worker processes (as upstream's MultiprocExecutor): the same path for TP=1 and TP>1, and
        # a worker crash cannot take the driver down. (0.12-0.17 would pick in-process "uni".)
        distributed_executor_backend=opts.distributed_executor_backend,
        # A prefix-cache hit skips computing the cached positions: they would never be captured.
        enable_prefix_caching=False,
        seed=opts.seed,
        enable_expert_parallel=opts.enable_expert_parallel,
    )
    kw.update(_multi_node_args(opts))
    if opts.quantization:
        kw["quantization"] = opts.quantization
    if opts.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = opts.max_num_batched_tokens
    if opts.max_num_seqs:
        kw["max_num_seqs"] = opts.max_num_seqs
    if strategy == "disable":
        kw["async_scheduling"] = False
    if facts_mod.probe().engine_args_language_model_only:
        # Extraction feeds token ids only. For a multimodal wrapper (Kimi-K2.5) this leaves the
        # vision tower unbuilt and unprofiled (vLLM 0.17+; a no-op for text models).
        kw["language_model_only"] = True
    kw.update(opts.engine_kwargs)
    if kw.get("enable_prefix_caching"):
        raise ValueError(
            "enable_prefix_caching=True would skip computing cached prefixes, whose "
            "hidden states then could not be captured"
        )
    return EngineArgs(**kw).create_engine_config()


def _multi_node_args(opts: EngineOptions) -> dict:
    """vLLM's multi-node settings of the multiprocessing executor, where more than one host is asked
    for (checked by ``check_nodes``); refused by name on a vLLM whose EngineArgs has none (before 0.32)."""
    if opts.nnodes == 1:
        return {}
    from vllm.engine.arg_utils import EngineArgs

    if "nnodes" not in getattr(EngineArgs, "__dataclass_fields__", {}):
        raise ValueError("this vLLM's multiprocessing executor runs on one host only (nnodes: vLLM 0.32+); use Ray")
    kw = dict(nnodes=opts.nnodes, node_rank=opts.node_rank, master_addr=opts.master_addr)
    if opts.master_port:
        kw["master_port"] = opts.master_port
    return kw


def check_nodes(opts: EngineOptions) -> None:
    """The multi-host settings, before vLLM starts (``_multi_node_args``)."""
    if opts.nnodes == 1 and opts.node_rank == 0:
        return
    if int_at_least(1).wrong(opts.nnodes) or int_at_least(0).wrong(opts.node_rank) or opts.node_rank >= opts.nnodes:
        raise ValueError(f"node_rank must be in 0..nnodes-1 and nnodes >= 1, not {opts.node_rank!r} of {opts.nnodes!r}")
    if opts.distributed_executor_backend != "mp":
        raise ValueError("nnodes/node_rank are the multiprocessing executor's; Ray places workers on its nodes itself")
    if not opts.master_addr:
        raise ValueError("a run over several hosts needs master_addr: the address of node rank 0 (the driver's host)")


def _pin_v1_runner() -> None:
    """Run the V1 model runner where vLLM still has it (0.11-0.33): the runner every release of the
    matrix is tested with. Model Runner V2 (opt-in there, default for some models from 0.24 on GPU)
    is what 0.34+ has only; capture reads its per-step input batch instead (capture.py: the state's runner_kind).
    A user who sets VLLM_USE_V2_MODEL_RUNNER=1 on a release that has both gets V2, said in the log."""
    from . import facts as facts_mod

    facts = facts_mod.probe()
    v = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if not facts.has_v1_runner:
        if v is not None and v.strip().lower() in ("0", "false"):
            raise RuntimeError(
                f"VLLM_USE_V2_MODEL_RUNNER={v} asks for the V1 model runner, which vLLM {facts.version} "
                "no longer has (removed in 0.34). Unset it: capture works with Model Runner V2."
            )
        return
    if v not in (None, "", "0", "false", "False"):
        logger.info(
            "speculators_compat: VLLM_USE_V2_MODEL_RUNNER=%s: capturing with Model Runner V2 "
            "(the tests run vLLM 0.11-0.33 with the V1 runner, which is pinned when it is unset)",
            v,
        )
        return
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def choose_start_method(requested: str | None, cuda_devices: int, environ) -> str | None:
    """How vLLM should start the workers: ``requested`` if given; else ``spawn`` on a CUDA host unless
    ``VLLM_WORKER_MULTIPROC_METHOD`` is set; else None (vLLM's own choice).

    On a CUDA host vLLM forks unless it sees CUDA initialised, but a driver that has queried CUDA
    without initialising it can no longer fork workers that use it: they die at start-up
    ("Cannot re-initialize CUDA in forked subprocess"), as speculators 0.3.0's class + the import
    do on a CUDA host after importing speculators; spawned workers start there. The script needs the usual ``if __name__ == "__main__":`` guard."""
    if requested is not None:
        if requested not in ("fork", "spawn"):
            raise ValueError(f"worker_start_method must be 'fork' or 'spawn', not {requested!r}")
        return requested
    if cuda_devices > 0 and not environ.get("VLLM_WORKER_MULTIPROC_METHOD"):
        return "spawn"
    return None


# upstream 0.3.0's engine settings, kept for the patched class (a prefill-only workload)
UPSTREAM_MAX_NUM_SEQS = 32


UPSTREAM_MIN_BATCHED_TOKENS = 8192

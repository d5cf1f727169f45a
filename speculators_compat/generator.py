"""Drop-in ``VllmHiddenStatesGenerator``: speculators 0.3.0's constructor and ``generate()`` contract,
on our engine loop, for every vLLM 0.11 -> 0.32, with or without speculators installed.

Layer ids and their two conventions: layers.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from numbers import Integral
from typing import Any

from .checkpoint import check_checkpoint
from .engine import settings
from .engine.config import EngineOptions
from .engine.core import ExtractionEngine
from .engine.fp8 import SCALES_KEY, Fp8States
from .errors import CaptureError, CheckpointError, TokenIdError
from .host import cuda_device_count
from .layers import default_layer_ids, normalize_layer_ids, read_num_layers
from .layers import resolve as resolve_layers

logger = logging.getLogger("speculators_compat")


_INT = {int}


def token_tensor(ids: list[int]):
    """A LongTensor of validated token ids (3x faster than ``torch.as_tensor`` on a list)."""
    import array

    import torch

    return torch.frombuffer(array.array("q", ids), dtype=torch.long) if ids else torch.zeros(0, dtype=torch.long)


def _array_to_lists(arr: Any, what: str, rank: int) -> list | None:
    """A torch tensor or numpy array of integers as nested lists, checked to have ``rank``
    dimensions (``None`` if ``arr`` is neither); ``what`` names it in errors."""
    if hasattr(arr, "dim") and hasattr(arr, "is_floating_point"):  # torch.Tensor
        import torch

        ndim = arr.dim()
        integral = not (arr.is_floating_point() or arr.is_complex() or arr.dtype == torch.bool)
    elif hasattr(arr, "ndim") and hasattr(getattr(arr, "dtype", None), "kind"):  # numpy.ndarray
        ndim, integral = arr.ndim, arr.dtype.kind in "iu"
    else:
        return None
    if ndim != rank:
        if rank == 2:  # the batch
            raise ValueError(f"{what} {type(arr).__name__} must be 2-D [batch, seq], got shape {tuple(arr.shape)}")
        raise ValueError(f"{what} must be {rank}-D, got a {type(arr).__name__} of shape {tuple(arr.shape)}")
    if not integral:
        raise TypeError(f"{what} {type(arr).__name__} must hold integers, not {arr.dtype}")
    return arr.tolist()


def to_token_lists(token_ids: Any, vocab_size: int | None = None) -> list[list[int]]:
    """Validate a batch: a list of token-id sequences (lists, tuples, 1-D integer tensors or numpy
    arrays; numpy / torch integer scalars are accepted), or a 2-D integer tensor / numpy array.
    With ``vocab_size``, an id at or above it raises TokenIdError (a ValueError naming the sequence)."""
    as_lists = _array_to_lists(token_ids, "token_ids", 2)
    if as_lists is not None:
        token_ids = as_lists
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids must be a list of token-id lists, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise ValueError("token_ids cannot be empty")
    out = []
    for i, seq in enumerate(token_ids):
        as_list = _array_to_lists(seq, f"sequence {i}", 1)
        if as_list is not None:
            seq = as_list
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
            raise TypeError(f"sequence {i} must be a list of token ids, got {type(seq).__name__}")
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty")
        if (
            set(map(type, seq)) == _INT
            and min(seq) >= 0  # the common case, ~2x faster than the loop
            and (vocab_size is None or max(seq) < vocab_size)
        ):
            out.append(list(seq))
            continue
        for t in seq:  # find the first bad token and name it
            if isinstance(t, bool) or not isinstance(t, Integral):
                raise TypeError(f"sequence {i} holds a non-integer token {t!r} ({type(t).__name__})")
            if t < 0:
                raise TokenIdError(i, int(t), vocab_size)
        hi = max(seq)
        if vocab_size is not None and hi >= vocab_size:
            raise TokenIdError(i, int(hi), vocab_size)
        out.append([int(t) for t in seq])  # numpy / torch integer scalars become plain ints
    return out


class VllmHiddenStatesGenerator:
    """Extract per-token hidden states of chosen decoder layers during prefill.

    Same constructor and ``generate()`` contract as speculators 0.3.0's class; the extra keyword
    arguments are ours. ``trust_remote_code`` is explicit (default False): Kimi-K2.5 needs it,
    because its HF config/tokenizer classes (``KimiK25Config``, TikToken tokenizer) and its image
    processor ship as code inside the checkpoint, not in transformers.

    Multimodal wrappers run text only: on vLLM 0.17+ the engine is built with
    ``language_model_only=True``, so a VLM's vision tower (Kimi-K2.5's MoonViT) is neither loaded nor
    profiled with dummy images (``engine_kwargs={"language_model_only": False}`` overrides it).
    vLLM 0.15/0.16 have no such switch and build the tower as serving would.

    ``zero_copy`` (default: ``SPECULATORS_COMPAT_ZERO_COPY``, on): the returned tensors lie over the
    engine's /dev/shm arena, no copy; each keeps its slab there until every tensor over it is
    dropped (``.clone()`` what you keep for long). False copies every row out.

    ``self_check`` (default: ``SPECULATORS_COMPAT_SELF_CHECK``, off; ``extract`` turns it on): for
    every prompt, the token vLLM sampled at its last position must be the one our captured
    final-layer state there implies (the model's final norm and lm_head, in the workers), else
    ``generate()`` raises ``CaptureError`` naming the prompt; ``engine.self_check_stats`` counts
    what was checked. Opt-in here because it costs about 1% of ``generate()`` on a GPU
    (docs/benchmarks.md); ``engine.self_check = True`` turns it on for an engine already built.

    ``states_dtype`` (default ``"auto"``: the model's dtype): ``"fp8"`` quantizes the states in the
    workers, on the device, as speculators' hs-connectors ``fp8`` backend does (e4m3, one float32
    scale per token over every captured layer: engine/fp8.py). ``generate()`` then returns each
    layer as e4m3 ``[len, hidden]`` and adds ``hidden_states_scales``, float32 ``[len, 1]``;
    ``hidden_states[j].to(torch.bfloat16) * hidden_states_scales.to(torch.bfloat16)`` is layer j
    (``speculators_compat.engine.fp8.dequantize``). The self-check and the NaN/Inf check look at
    the unquantized states.
    """

    def __init__(
        self,
        model_path: str,
        layer_ids: list[int] | None = None,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.8,
        tensor_parallel_size: int = 1,
        *,
        layer_id_convention: str = "upstream",
        on_overlength: str = "truncate",
        zero_copy: bool | None = None,
        self_check: bool | None = None,
        engine_kwargs: dict | None = None,
        **engine: Any,
    ):
        """``engine``: any other engine setting by name (EngineOptions' declared fields, the flags of
        ``extract``: ``pipeline_parallel_size``, ``dtype``, ``states_dtype``, ``nnodes``, ...)."""
        if isinstance(model_path, os.PathLike):
            model_path = os.fspath(model_path)  # (vLLM itself calls str methods on it)
        if not isinstance(model_path, str):
            raise TypeError(f"model_path must be a path (str or os.PathLike), not {type(model_path).__name__}")
        if on_overlength not in ("truncate", "error"):
            raise ValueError(f"on_overlength must be 'truncate' or 'error', not {on_overlength!r}")
        engine = settings.keywords(
            EngineOptions,
            dict(
                engine,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
            ),
        )
        opts = EngineOptions(
            model=model_path,
            zero_copy=zero_copy,
            self_check=self_check,
            engine_kwargs=dict(engine_kwargs or {}),
            **engine,
        )
        if opts.distributed_executor_backend != "ray":  # (Ray places the workers on its cluster's nodes)
            _check_devices(opts.tensor_parallel_size, opts.pipeline_parallel_size, opts.nnodes)
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.on_overlength = on_overlength
        self._tokenizer = None
        check_checkpoint(model_path)  # a damaged or missing file named now, not as a worker's start-up failure
        num_layers = read_num_layers(model_path, opts.trust_remote_code)
        self.num_layers = num_layers
        self.layer_ids = resolve_layers(layer_ids, num_layers, layer_id_convention)
        self.layer_id_convention = layer_id_convention
        self._engine = ExtractionEngine(opts, self.layer_ids)
        if self._engine.model_info["num_layers"] != num_layers:
            raise RuntimeError(
                f"config.json says {num_layers} layers but vLLM built {self._engine.model_info['num_layers']}"
            )
        self.vllm_config = self._engine.vllm_config

    # upstream exposed these attributes
    @property
    def executor(self):
        return self._engine.executor

    @property
    def scheduler(self):
        return self._engine.scheduler

    @property
    def engine(self) -> ExtractionEngine:
        return self._engine

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.model_path, trust_remote_code=self.vllm_config.model_config.trust_remote_code
            )
        return self._tokenizer

    def generate(self, token_ids) -> list[dict]:
        """Hidden states for a batch. Returns, in input order, dicts with ``input_ids`` (LongTensor),
        ``hidden_states`` (one [len, hidden] tensor per layer id, in ``layer_ids`` order) and
        ``loss_mask`` (None); with ``states_dtype="fp8"`` also ``hidden_states_scales`` (class
        docstring). Sequences longer than ``max_model_len - 1`` are truncated (upstream's
        behaviour; a warning names them) or rejected with ``on_overlength="error"``."""

        seqs = to_token_lists(token_ids, self._engine.vocab_size)
        seqs = self._fit(seqs)
        states = self._engine.run(seqs, ids_checked=True)
        results = []
        # NaN/Inf rows are detected on the device by the capture (CaptureError names the prompt)
        for ids, layers in zip(seqs, states):
            if isinstance(layers, Fp8States):
                results.append(
                    {
                        "input_ids": token_tensor(ids),
                        "hidden_states": layers.layers,
                        SCALES_KEY: layers.scales,
                        "loss_mask": None,
                    }
                )
            else:
                results.append({"input_ids": token_tensor(ids), "hidden_states": layers, "loss_mask": None})
        return results

    def _fit(self, seqs: list[list[int]]) -> list[list[int]]:
        max_len = self._engine.max_model_len - 1
        long = [i for i, s in enumerate(seqs) if len(s) > max_len]
        if not long:
            return seqs
        msg = (
            f"{len(long)} sequence(s) longer than max_model_len - 1 = {max_len} tokens "
            f"(indices {long[:10]}{'...' if len(long) > 10 else ''})"
        )
        if self.on_overlength == "error":
            raise ValueError(msg + "; raise max_model_len or shorten them")
        logger.warning("speculators_compat: %s: truncated to %d tokens, as upstream does", msg, max_len)
        return [s[:max_len] for s in seqs]

    def close(self) -> None:
        eng = getattr(self, "_engine", None)
        if eng is not None:
            eng.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def _check_devices(tp: int, pp: int = 1, nnodes: int = 1) -> None:
    """Fail fast when tensor x pipeline parallelism asks for more GPUs than this machine has (the
    multiprocessing executor's workers are on this host, or this host's share over ``nnodes``)."""
    # (cuda_device_count asks NVML; torch.cuda.is_available() would call cudaGetDeviceCount, which
    # poisons fork: vLLM, seeing CUDA not initialised, forks its workers and they die at start-up)
    n = cuda_device_count()
    what = f"tensor_parallel_size={tp}" + (f" x pipeline_parallel_size={pp} = {tp * pp} workers" if pp > 1 else "")
    if nnodes > 1:
        what += f" over {nnodes} hosts ({tp * pp // nnodes} on this one)"
    if n > 0:
        if tp * pp // max(nnodes, 1) > n:
            raise ValueError(f"{what} but only {n} CUDA device(s) are visible")
    elif tp > (os.cpu_count() or 1):
        raise ValueError(
            f"{what} but this CPU-only machine has {os.cpu_count()} cores "
            "(vLLM's CPU backend binds one worker per core group)"
        )


__all__ = [
    "VllmHiddenStatesGenerator",
    "default_layer_ids",
    "normalize_layer_ids",
    "read_num_layers",
    "to_token_lists",
    "CaptureError",
    "CheckpointError",
    "TokenIdError",
]

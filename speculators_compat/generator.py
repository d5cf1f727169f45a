"""Drop-in ``VllmHiddenStatesGenerator``: speculators 0.3.0's constructor and ``generate()`` contract,
on our engine loop, for every vLLM 0.11 -> 0.32, with or without speculators installed.

Layer-id convention (``layer_id_convention``):
  * ``"upstream"`` (default, speculators 0.3.0): id ``L`` is the output of decoder layer ``L``
    (0-based), residual included, *before* the final norm. ``L = n-1`` is the last layer's
    output before the norm (HF's ``hidden_states[-1]`` is after the norm, so it differs).
    For L < n-1 it equals HF ``output_hidden_states[L + 1]``.
  * ``"eagle3"`` (vLLM's native EAGLE-3 / ``extract_hidden_states`` ids): id ``i`` is the output of
    ``i`` decoder layers, i.e. upstream id ``i - 1``; ``i = n`` is the last layer. Id 0 (the
    embeddings) is not captured.
Upstream's default ids are ``[2, n//2, n-3, n-1]`` (Kimi-K2.5, n=61: ``[2, 30, 58, 60]``), which are
vLLM native ``[3, 31, 59, 61]``.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from numbers import Integral
from typing import Any, Iterable, Sequence

from .checkpoint import CheckpointError, check_checkpoint
from .engine.core import CaptureError, EngineOptions, ExtractionEngine, TokenIdError

logger = logging.getLogger("speculators_compat")

# Upstream 0.3.0's engine settings, kept for the patched class (prefill-only workload).
UPSTREAM_MAX_NUM_SEQS = 32
UPSTREAM_MIN_BATCHED_TOKENS = 8192


def read_num_layers(model_path: str, trust_remote_code: bool = False) -> int:
    """Decoder layer count from config.json (``num_hidden_layers``, or ``text_config``'s for VLMs)."""
    cfg_file = Path(model_path) / "config.json"
    cfg: Any
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        get = cfg.get
        text = cfg.get("text_config") or {}
        tget = text.get
    else:
        looks_local = model_path.startswith(("/", "./", "../", "~")) or model_path.count("/") != 1
        if looks_local or os.path.isdir(model_path):
            what = "has no config.json" if os.path.isdir(model_path) else "does not exist"
            raise FileNotFoundError(f"model path {model_path!r} {what}")
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        get = lambda k, d=None: getattr(c, k, d)  # noqa: E731
        t = getattr(c, "text_config", None)
        tget = (lambda k, d=None: getattr(t, k, d)) if t is not None else (lambda k, d=None: d)  # noqa: E731
    n = get("num_hidden_layers") or tget("num_hidden_layers")
    if not n:
        raise ValueError(f"cannot determine the number of decoder layers of {model_path} "
                         "(no num_hidden_layers in its config or text_config)")
    return int(n)


def default_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def normalize_layer_ids(layer_ids: Sequence[int] | None, num_layers: int, convention: str = "upstream",
                        allow_duplicates: bool = False) -> list[int]:
    """Validate ids and convert them to upstream's convention (output of decoder layer L)."""
    if convention not in ("upstream", "eagle3"):
        raise ValueError(f"layer_id_convention must be 'upstream' or 'eagle3', not {convention!r}")
    if layer_ids is None:
        return default_layer_ids(num_layers)
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Iterable):
        raise TypeError(f"layer_ids must be a list of integers, not {type(layer_ids).__name__}")
    ids = list(layer_ids)
    if not ids:
        raise ValueError("layer_ids is empty: give at least one decoder layer id")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, Integral):
            raise TypeError(f"layer ids must be integers, got {i!r} ({type(i).__name__})")
    ids = [int(i) for i in ids]  # numpy / torch integers become plain ints
    if not allow_duplicates and len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate layer ids {dup}")
    if convention == "eagle3":
        bad = [i for i in ids if not 1 <= i <= num_layers]
        if bad:
            raise ValueError(f"eagle3 layer ids {bad} out of range [1, {num_layers}] (id 0, the "
                             "embeddings, is not captured)")
        return [i - 1 for i in ids]
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"Layer index {bad[0]} out of bounds [0, {num_layers - 1}]")
    return ids


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
        if (set(map(type, seq)) == _INT and min(seq) >= 0  # the common case, ~2x faster than the loop
                and (vocab_size is None or max(seq) < vocab_size)):
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
    """

    def __init__(self, model_path: str, layer_ids: list[int] | None = None, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.8, tensor_parallel_size: int = 1, *,
                 dtype: str = "auto", quantization: str | None = None, trust_remote_code: bool = False,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 enable_expert_parallel: bool = False, async_scheduling: str | None = None,
                 layer_id_convention: str = "upstream", on_overlength: str = "truncate",
                 engine_kwargs: dict | None = None):
        if isinstance(model_path, os.PathLike):
            model_path = os.fspath(model_path)  # (vLLM itself calls str methods on it)
        if not isinstance(model_path, str):
            raise TypeError(f"model_path must be a path (str or os.PathLike), not {type(model_path).__name__}")
        if on_overlength not in ("truncate", "error"):
            raise ValueError(f"on_overlength must be 'truncate' or 'error', not {on_overlength!r}")
        if (isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int)
                or tensor_parallel_size < 1):
            raise ValueError(f"tensor_parallel_size must be a positive integer, not {tensor_parallel_size!r}")
        _check_devices(tensor_parallel_size)
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.on_overlength = on_overlength
        self._tokenizer = None
        check_checkpoint(model_path)  # a damaged or missing file named now, not as a worker's start-up failure
        num_layers = read_num_layers(model_path, trust_remote_code)
        self.num_layers = num_layers
        self.layer_ids = normalize_layer_ids(layer_ids, num_layers, layer_id_convention)
        self.layer_id_convention = layer_id_convention
        opts = EngineOptions(
            model=model_path, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size, dtype=dtype, quantization=quantization,
            trust_remote_code=trust_remote_code, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enable_expert_parallel=enable_expert_parallel,
            async_scheduling=async_scheduling, engine_kwargs=dict(engine_kwargs or {}))
        self._engine = ExtractionEngine(opts, self.layer_ids)
        if self._engine.model_info["num_layers"] != num_layers:
            raise RuntimeError(f"config.json says {num_layers} layers but vLLM built "
                               f"{self._engine.model_info['num_layers']}")
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
                self.model_path, trust_remote_code=self.vllm_config.model_config.trust_remote_code)
        return self._tokenizer

    def generate(self, token_ids) -> list[dict]:
        """Hidden states for a batch. Returns, in input order, dicts with ``input_ids`` (LongTensor),
        ``hidden_states`` (one [len, hidden] tensor per layer id, in ``layer_ids`` order) and
        ``loss_mask`` (None). Sequences longer than ``max_model_len - 1`` are truncated (upstream's
        behaviour; a warning names them) or rejected with ``on_overlength="error"``."""
        import torch

        seqs = to_token_lists(token_ids, self._engine.vocab_size)
        seqs = self._fit(seqs)
        states = self._engine.run(seqs, ids_checked=True)
        results = []
        # NaN/Inf rows are detected on the device by the capture (CaptureError names the prompt)
        for ids, layers in zip(seqs, states):
            results.append({"input_ids": token_tensor(ids),
                            "hidden_states": layers, "loss_mask": None})
        return results

    def _fit(self, seqs: list[list[int]]) -> list[list[int]]:
        max_len = self._engine.max_model_len - 1
        long = [i for i, s in enumerate(seqs) if len(s) > max_len]
        if not long:
            return seqs
        msg = (f"{len(long)} sequence(s) longer than max_model_len - 1 = {max_len} tokens "
               f"(indices {long[:10]}{'...' if len(long) > 10 else ''})")
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


def cuda_device_count() -> int:
    """Visible CUDA devices, without initialising CUDA or poisoning fork (NVML where torch can)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda._is_compiled() else 0


def _check_devices(tp: int) -> None:
    """Fail fast when tensor parallelism asks for more GPUs than this machine has."""
    try:
        import torch
    except ImportError:
        return
    # device_count() asks NVML; torch.cuda.is_available() would call cudaGetDeviceCount, which
    # poisons fork: vLLM (seeing CUDA not initialised) forks its workers and they die at start-up.
    n = cuda_device_count()
    if n > 0:
        if tp > n:
            raise ValueError(f"tensor_parallel_size={tp} but only {n} CUDA device(s) are visible")
    elif tp > (os.cpu_count() or 1):
        raise ValueError(f"tensor_parallel_size={tp} but this CPU-only machine has {os.cpu_count()} cores "
                         "(vLLM's CPU backend binds one worker per core group)")


__all__ = ["VllmHiddenStatesGenerator", "default_layer_ids", "normalize_layer_ids", "read_num_layers",
           "to_token_lists", "CaptureError", "CheckpointError", "TokenIdError"]

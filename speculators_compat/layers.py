"""Decoder layer ids: how many layers a checkpoint has (from its config.json, no torch), upstream's
default ids, and the two conventions.

  * ``"upstream"`` (default, speculators 0.3.0): id ``L`` is the output of decoder layer ``L``
    (0-based), residual included, *before* the final norm. ``L = n-1`` is the last layer's
    output before the norm (HF's ``hidden_states[-1]`` is after the norm, so it differs).
    For L < n-1 it equals HF ``output_hidden_states[L + 1]``.
  * ``"eagle3"`` (vLLM's native EAGLE-3 / ``extract_hidden_states`` ids): id ``i`` is the output of
    ``i`` decoder layers, i.e. upstream id ``i - 1``; ``i = n`` is the last layer. Id 0 (the
    embeddings) is not captured.

The final state after the model's last norm (what HF's ``output_hidden_states[-1]`` holds, and what
drafters that train on the normed state take) is one more id, one past the last layer: ``n`` in
upstream's convention, ``n + 1`` in vLLM's (``final_layer_id``). speculators' EAGLE-3 trainers take
the last layer's output *before* the norm as the verifier's state (``n - 1`` / ``n``).

speculators >= 0.5 (``--format speculators-hs``) names ids in vLLM's convention and defaults to
``[2, n//2, n-3, n]``. Upstream's (0.3.x/0.4.x) default ids are ``[2, n//2, n-3, n-1]``
(Kimi-K2.5, n=61: ``[2, 30, 58, 60]``), which are vLLM native ``[3, 31, 59, 61]``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from numbers import Integral
from pathlib import Path
from typing import Any


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

        from .errors import CheckpointError

        try:
            c = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except OSError as e:  # the hub offline or the id unknown (also a mistyped local path)
            raise CheckpointError(
                f"model {model_path!r} is no directory here, and as a hub id its config could not be "
                f"fetched ({str(e).splitlines()[0] if str(e) else type(e).__name__}): give the local "
                "directory holding config.json and the weights"
            ) from None
        get = lambda k, d=None: getattr(c, k, d)  # noqa: E731
        t = getattr(c, "text_config", None)
        tget = (lambda k, d=None: getattr(t, k, d)) if t is not None else (lambda k, d=None: d)  # noqa: E731
    n = get("num_hidden_layers") or tget("num_hidden_layers")
    if not n:
        raise ValueError(
            f"cannot determine the number of decoder layers of {model_path} "
            "(no num_hidden_layers in its config or text_config)"
        )
    return int(n)


def final_layer_id(num_layers: int, convention: str = "upstream") -> int:
    """The id of the final state after the model's norm: one past the last decoder layer."""
    return num_layers + 1 if convention == "eagle3" else num_layers


def default_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def native_default_layer_ids(num_layers: int) -> list[int]:
    """speculators >= 0.5's default ids, in vLLM's (``"eagle3"``) convention: ``[2, n//2, n-3, n]``
    (the last layer included)."""
    return [2, num_layers // 2, num_layers - 3, num_layers]


def normalize_layer_ids(
    layer_ids: Sequence[int] | None, num_layers: int, convention: str = "upstream", allow_duplicates: bool = False
) -> list[int]:
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
        bad = [i for i in ids if not 1 <= i <= num_layers + 1]
        if bad:
            raise ValueError(
                f"eagle3 layer ids {bad} out of range [1, {num_layers + 1}] (id 0, the embeddings, is not "
                f"captured; {num_layers + 1} is the final state after the norm)"
            )
        return [i - 1 for i in ids]
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"Layer index {bad[0]} out of bounds [0, {num_layers}] ({num_layers}: the final state after the norm)"
        )
    return ids


def resolve(
    layer_ids: Sequence[int] | None,
    num_layers: int,
    convention: str | None = None,
    fmt: str | None = None,
) -> list[int]:
    """The one rule for which layers a run captures, in upstream's convention (what the engine and
    the files use). ``convention`` None: ``eagle3`` (vLLM's, speculators >= 0.5's) for
    ``--format speculators-hs``, else ``upstream``. No ids: speculators >= 0.5's default for that
    format (a model under 6 layers repeats an id there, as speculators' own default does), else
    upstream's. ``extract``, ``plan``, ``--dry-run`` and the generator all ask this."""
    from .files.registry import get_format

    native = fmt is not None and get_format(fmt).layer_ids == "eagle3"
    convention = convention or ("eagle3" if native else "upstream")
    if layer_ids is None and native:
        return normalize_layer_ids(native_default_layer_ids(num_layers), num_layers, "eagle3", allow_duplicates=True)
    return normalize_layer_ids(layer_ids, num_layers, convention)


def stage_ranges(num_layers: int, stages: int, partition: str | None = None) -> list[tuple[int, int]]:
    """Which decoder layers each pipeline stage computes, ``[(start, end), ...]``, as vLLM splits
    them (``vllm.distributed.utils.get_pp_indices``): ``partition`` (``VLLM_PP_LAYER_PARTITION``,
    comma-separated counts; default: that variable) if given, else an even split whose remainder
    goes to the stages before the last, from the second-to-last backwards. The engine reports the
    split its workers really made (``model_info["stages"]``); tests hold the two equal."""
    if partition is None:
        partition = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if partition:
        try:
            counts = [int(x) for x in partition.split(",")]
        except ValueError as e:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={partition!r}: expected comma-separated integers") from e
        if len(counts) != stages or sum(counts) != num_layers:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={partition!r}: needs {stages} counts summing to {num_layers} layers"
            )
    else:
        if stages > num_layers:
            raise ValueError(f"{stages} pipeline stages but the model has {num_layers} decoder layers")
        counts = [num_layers // stages] * stages
        for i in range(2, num_layers % stages + 2):
            counts[-i] += 1
    starts = [sum(counts[:i]) for i in range(stages)]
    return [(s, s + c) for s, c in zip(starts, counts)]

"""FP8 (e4m3) hidden states with one float32 scale per token, in speculators' own layout.

speculators >= 0.9 (its hs-connectors ``fp8`` backend) stores a sample's states ``[T, L, H]`` as
``float8_e4m3fn`` with one float32 scale per token taken over all its captured layers, and its
reader multiplies back. The arithmetic, which ours must match bit for bit so that its readers give
back what ours would:

    amax  = max |x| over [L, H], in float32           (one per token)
    scale = max(amax / 448, 1e-12)                     (448: e4m3's largest finite value)
    q     = (x in float32 / scale) rounded to e4m3     ("round to nearest even", saturating is not
                                                        needed: |x / scale| <= 448)
    x'    = q * scale                                  (their reader: in the dtype it asks for)

Rounding bound: e4m3 keeps 3 mantissa bits, so a value at or above e4m3's smallest normal
(2^-6 after scaling) is within 2^-4 of itself (relative); values below it are subnormal, with an
absolute step of 2^-9 x scale. Per token, then, |x' - x| <= max(2^-4 |x|, 2^-10 x scale) before
the reader's own rounding to its dtype (bfloat16 adds 2^-9 relative).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

# (torch is imported in each function: the writers and verify import this module in environments
# that may have no torch)

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12
SCALES_KEY = "hidden_states_scales"  # the name speculators' files give the scales


@dataclass
class Fp8States:
    """One request's FP8 states as the engine returns them: ``layers``, e4m3 ``[T, H]`` per captured
    layer (in layer_ids order), and ``scales``, float32 ``[T, 1]`` shared by every layer:
    ``layers[j].to(dtype) * scales.to(dtype)`` gives layer j back (``dequantize``)."""

    layers: list
    scales: Any  # torch.Tensor


def fp8_dtype():
    import torch

    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no float8_e4m3fn: FP8 states need torch >= 2.1")
    return dtype


def quantize_per_token(states):
    """``states`` ``[T, ...]`` (any float dtype, any device) -> (e4m3 ``[T, ...]``, float32 scales
    ``[T, 1, ...]`` of the same rank), by the module docstring's arithmetic."""
    x = states.float()
    dims = tuple(range(1, x.dim()))
    scale = (x.abs().amax(dim=dims, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x / scale).to(fp8_dtype()), scale


def quantize_rows(layers: list) -> tuple[list, Any]:
    """The same arithmetic on a step's rows held per layer (``[T, H]`` each, one device): e4m3
    rows per layer and float32 scales ``[T]``, bit for bit ``quantize_per_token`` of the rows
    stacked ``[T, L, H]``, without the stacked float32 copy. (|x| and its maximum are exact in
    any float dtype, so the amax is taken before the cast.)"""
    import torch

    # max |x| in one pass a layer (the infinity norm: no |x| tensor is made), and the division
    # in float32 by type promotion (no float32 copy of the rows): the same values, fewer passes
    amax = torch.stack([torch.linalg.vector_norm(x, float("inf"), dim=-1) for x in layers]).amax(dim=0).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    col = scale[:, None]
    return [torch.div(x, col).to(fp8_dtype()) for x in layers], scale


def dequantize(q, scale, dtype=None):
    """What speculators' reader gives back: ``q`` and ``scale`` in ``dtype`` (default bfloat16),
    multiplied."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    return q.to(dtype) * scale.to(dtype)


# -- FP8 states in torch.save files (``--format pt``) -------------------------------------------------
# A ``data_{i}.pt`` file of FP8 states holds, under "hidden_states", a call of ``load_fp8_hidden_states``
# on (e4m3 layers, scales, dtype name) instead of a list of tensors. Loaded where the registry patch
# ``torch_load_fp8_states`` is on (``import speculators_compat``, ``speculators-compat run``), the
# call gives back the list of dequantized layers that speculators 0.3/0.4's trainers expect; loaded
# anywhere else it fails (torch.load with weights_only: an unsupported global naming this function),
# never handing e4m3 values to a reader that would take them for states.

_loader = {"on": False}
_raw = threading.local()


class PtStates:
    """What ``torch.save`` writes for FP8 layers: the call ``load_fp8_hidden_states(layers, scales,
    dtype)``."""

    def __init__(self, layers: list, scales, dtype: str):
        self.args = (list(layers), scales, dtype)

    def __reduce__(self):
        return (load_fp8_hidden_states, self.args)


def load_fp8_hidden_states(layers: list, scales, dtype: str):
    """The loader a data_{i}.pt file of FP8 states calls (see above): each layer dequantized to
    ``dtype`` (the model's), or under ``raw_pt_states()`` the ``Fp8States`` themselves. Every such
    file names this function by its import path: keep it here, under this name, for good
    (tests/data/fp8_states_v1.pt)."""
    if getattr(_raw, "on", False):
        return Fp8States(list(layers), scales)
    if not _loader["on"]:
        raise RuntimeError(
            "this file holds FP8 hidden states, dequantized at load by speculators_compat's "
            "torch_load_fp8_states patch, which is off (unpatch() or SPECULATORS_COMPAT_DISABLE): "
            "import speculators_compat with its patches on, or run under `speculators-compat run`"
        )
    import torch

    target = getattr(torch, dtype)
    return [dequantize(q, scales, target) for q in layers]


def set_pt_loader(on: bool) -> None:
    """The registry patch's switch (patches/torch_fp8_states.py)."""
    _loader["on"] = bool(on)


@contextlib.contextmanager
def raw_pt_states():
    """Within it (this thread), data_{i}.pt files of FP8 states load as ``Fp8States`` (verify, tests)."""
    import torch

    before = getattr(_raw, "on", False)
    _raw.on = True
    allowed = load_fp8_hidden_states in torch.serialization.get_safe_globals()
    try:
        # (torch's context takes the global off its list on leaving, even one that was on it before)
        with contextlib.nullcontext() if allowed else torch.serialization.safe_globals([load_fp8_hidden_states]):
            yield
    finally:
        _raw.on = before

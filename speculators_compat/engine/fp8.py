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

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12
SCALES_KEY = "hidden_states_scales"  # the name speculators' files give the scales


def fp8_dtype() -> torch.dtype:
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no float8_e4m3fn: FP8 states need torch >= 2.1")
    return dtype


def quantize_per_token(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` ``[T, ...]`` (any float dtype, any device) -> (e4m3 ``[T, ...]``, float32 scales
    ``[T, 1, ...]`` of the same rank), by the module docstring's arithmetic."""
    x = states.float()
    dims = tuple(range(1, x.dim()))
    scale = (x.abs().amax(dim=dims, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x / scale).to(fp8_dtype()), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What speculators' reader gives back: ``q`` and ``scale`` in ``dtype``, multiplied."""
    return q.to(dtype) * scale.to(dtype)

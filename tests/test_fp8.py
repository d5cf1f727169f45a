"""FP8 states (engine/fp8.py): bit for bit what speculators' own quantizer (hs-connectors 0.9.0,
installed beside the newest engine environment) gives for the same states, and within the stated
rounding bound of them."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

from speculators_compat.engine import fp8  # noqa: E402

RELEASE = Path(sys.prefix) / "speculators-releases" / "0.9.0"


def _states(seed=0, t=37, layers=4, hidden=96, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, layers, hidden, generator=g) * torch.logspace(-3, 2, t)[:, None, None]
    x[3] = 0  # a token of zeros: the scale's floor
    x[5, 1, 7] = 1e4  # one outlier: its token's scale
    return x.to(dtype)


@pytest.fixture(scope="module")
def theirs():
    if not (RELEASE / "hs_connectors" / "fp8_utils.py").is_file():
        pytest.skip(f"hs-connectors 0.9.0 is not installed at {RELEASE} (scripts/engine_env.py puts it there)")
    sys.path.insert(0, str(RELEASE))
    try:
        from hs_connectors import fp8_utils
    finally:
        sys.path.remove(str(RELEASE))
    return fp8_utils


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_our_fp8_bytes_and_scales_are_speculators_own(theirs, dtype):
    x = _states(dtype=dtype)
    q, s = fp8.quantize_per_token(x)
    q2, s2 = theirs.quantize_tensor_to_fp8(x)
    assert q.dtype == q2.dtype == torch.float8_e4m3fn and s.dtype == s2.dtype == torch.float32
    assert q.shape == x.shape and s.shape == (x.shape[0], 1, 1) == s2.shape
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(fp8.dequantize(q, s), theirs.dequantize_fp8_tensor(q2, s2))


def test_the_rounding_bound_holds():
    """|x' - x| <= max(2^-4 |x|, 2^-10 x scale) per value, in float32 (module docstring)."""
    x = _states(seed=3).float()
    q, s = fp8.quantize_per_token(x)
    back = fp8.dequantize(q, s, torch.float32)
    bound = torch.maximum(x.abs() * 2**-4, s.expand_as(x) * 2**-10)
    assert ((back - x).abs() <= bound).all()
    assert (back[3] == 0).all() and float(s[3]) == torch.tensor(fp8.MIN_SCALE).item()  # zeros stay zeros
    assert float(q[5].float().abs().max()) == fp8.FP8_MAX  # the outlier token's max maps to 448

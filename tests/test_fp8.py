"""FP8 states (engine/fp8.py): bit for bit what speculators' own quantizer (hs-connectors 0.9.0,
installed beside the newest engine environment) gives for the same states, and within the stated
rounding bound of them."""

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

from speculators_compat.engine import fp8  # noqa: E402
from tests.helpers import from_release  # noqa: E402


def _states(seed=0, t=37, layers=4, hidden=96, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, layers, hidden, generator=g) * torch.logspace(-3, 2, t)[:, None, None]
    x[3] = 0  # a token of zeros: the scale's floor
    x[5, 1, 7] = 1e4  # one outlier: its token's scale
    return x.to(dtype)


@pytest.fixture(scope="module")
def theirs():
    try:
        (fp8_utils,) = from_release("0.9.0", "hs_connectors.fp8_utils")
    except FileNotFoundError as e:
        pytest.skip(str(e))
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_layer_rows_quantize_as_the_stacked_states(dtype):
    """What the workers run (quantize_rows, one step's rows per layer) is bit for bit the stacked
    arithmetic; a layer listed twice changes nothing."""
    x = _states(seed=4, dtype=dtype)
    q, s = fp8.quantize_per_token(x)
    layers = [x[:, j] for j in range(x.shape[1])]
    rows, scales = fp8.quantize_rows(layers)
    assert torch.equal(torch.stack(rows, 1).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales, s[:, 0, 0])
    _, twice = fp8.quantize_rows(layers + [layers[1]])
    assert torch.equal(twice, scales)


def _pt_file(tmp_path, dtype="bfloat16"):
    from speculators_compat.files.formats import write_sample

    x = _states(seed=5)
    q, s = fp8.quantize_per_token(x)
    sample = {
        "input_ids": torch.arange(x.shape[0]),
        "hidden_states": [q[:, j] for j in range(q.shape[1])],
        "hidden_states_scales": s[:, :, 0],
        "loss_mask": torch.ones(x.shape[0], dtype=torch.long),
        "dequantize_dtype": dtype,
    }
    path = tmp_path / "data_0.pt"
    write_sample(path, sample, "pt")
    return path, q, s


def test_a_pt_file_of_fp8_states_dequantizes_at_load_only_with_the_patch(tmp_path):
    import pickle

    import speculators_compat
    from speculators_compat.registry import is_ours  # noqa: F401  (the registry is loaded)

    path, q, s = _pt_file(tmp_path)
    speculators_compat.patch()
    d = torch.load(path, weights_only=True, mmap=True)  # as speculators 0.3/0.4's dataset loads it
    assert [h.dtype for h in d["hidden_states"]] == [torch.bfloat16] * q.shape[1]
    assert all(torch.equal(h, fp8.dequantize(q[:, j], s[:, :, 0])) for j, h in enumerate(d["hidden_states"]))
    with fp8.raw_pt_states():  # (verify's view: the e4m3 bytes and scales themselves)
        raw = torch.load(path, weights_only=True)["hidden_states"]
    assert torch.equal(torch.stack(raw.layers, 1).view(torch.uint8), q.view(torch.uint8))
    assert fp8.load_fp8_hidden_states in torch.serialization.get_safe_globals()  # (left as it was)
    speculators_compat.unpatch()
    ser = torch.serialization
    others = [g for g in ser.get_safe_globals() if g is not fp8.load_fp8_hidden_states]
    try:
        with pytest.raises(RuntimeError, match="FP8 hidden states, dequantized at load by speculators_compat"):
            torch.load(path, weights_only=True)
        ser.clear_safe_globals()  # a reader that never imported speculators_compat
        ser.add_safe_globals(others)
        with pytest.raises(pickle.UnpicklingError, match=r"speculators_compat\.engine\.fp8\.load_fp8_hidden_states"):
            torch.load(path, weights_only=True)
    finally:
        speculators_compat.patch()
    assert torch.load(path, weights_only=True)["hidden_states"][0].dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "speculators-hs"])
def test_verify_checks_fp8_files(tmp_path, fmt):
    from speculators_compat.files.formats import write_sample
    from speculators_compat.files.registry import file_name
    from speculators_compat.pipeline.output.verify import check_fp8_file

    x = _states(seed=6)
    q, s = fp8.quantize_per_token(x)
    run = {"format": fmt, "layer_ids": [0, 1, 2, 3], "hidden_size": x.shape[-1], "states_dtype": "fp8"}

    def write(scales, layers=None):
        sample = {
            "input_ids": torch.arange(x.shape[0]),
            "hidden_states": layers if layers is not None else [q[:, j] for j in range(q.shape[1])],
            "hidden_states_scales": scales,
            "loss_mask": torch.ones(x.shape[0], dtype=torch.long),
            "dequantize_dtype": "bfloat16",
        }
        path = tmp_path / file_name(0, fmt)
        write_sample(path, sample, fmt)
        return check_fp8_file(path, run)

    assert write(s[:, :, 0]) is None
    zero = s[:, :, 0].clone()
    zero[2] = 0
    assert "a scale that is not finite and > 0" in write(zero)
    nan = s[:, :, 0].clone()
    nan[1] = float("nan")
    assert "not finite" in write(nan)
    assert "scales" in write(s[:-1, :, 0])
    bf16 = [x[:, j] for j in range(x.shape[1])]  # unquantized states where FP8 ones belong
    assert "bfloat16" in write(s[:, :, 0], bf16)
    assert "3 layers, not 4" in write(s[:, :, 0], [q[:, j] for j in range(3)])


def test_an_fp8_pt_file_of_the_first_layout_still_loads():
    """Every FP8 ``data_{i}.pt`` names its loader by import path (torch.save records the callable):
    ``speculators_compat.engine.fp8.load_fp8_hidden_states`` is that path for good. A file written
    in the first layout (tests/data/fp8_states_v1.pt, kept as made) loads to the states it held."""
    from pathlib import Path

    import speculators_compat

    data = Path(__file__).parent / "data"
    assert b"speculators_compat.engine.fp8" in (data / "fp8_states_v1.pt").read_bytes()
    speculators_compat.patch()
    try:
        got = torch.load(data / "fp8_states_v1.pt", weights_only=True)
    finally:
        speculators_compat.unpatch()
    want = torch.load(data / "fp8_states_v1.expected.pt", weights_only=True)
    assert got["input_ids"].tolist() == list(range(6))
    assert all(torch.equal(a, b) for a, b in zip(got["hidden_states"], want["hidden_states"], strict=True))

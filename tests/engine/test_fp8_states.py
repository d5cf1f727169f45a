"""FP8 states on the real engine (``states_dtype="fp8"``, ``--states-dtype fp8``): quantized in the
workers, bit for bit what speculators' own quantizer (hs-connectors 0.9.0's
``quantize_tensor_to_fp8``) gives for the same run's unquantized states, within the stated
rounding bound of them and of HF, with the self-check and the NaN/Inf check on the unquantized
rows; ``extract`` writes them in speculators' FP8 layout (read back by its ``FP8Transfer``) and as
``data_{i}.pt`` files that dequantize at load, about half the bytes, and ``verify`` checks them.

Rounding bound (engine/fp8.py): per value |x' - x| <= max(2^-4 |x|, 2^-10 x scale) in float32.
Against HF (per sequence and layer, relative Frobenius error): the engine dtype's tolerance
(testing/reference.py) plus 2^-4, the bound's relative part.
"""

from __future__ import annotations

import json

import pytest

from speculators_compat.testing import models, reference
from tests.helpers import from_release

torch = pytest.importorskip("torch")
# the library's own mechanics over the engine (the capture hooks are every version's): newest cell
pytestmark = pytest.mark.ends

LAYERS = [1, 2, 3, 5]
# 13 prompts (> 10), the long ones split over 64-token steps (chunked prefill)
MIXED = models.random_prompts([5, 300, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200, 3], seed=8)
ENGINE = dict(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, dtype="bfloat16")
FP8_REL = 2**-4


def hs_connectors():
    return from_release("0.9.0", "hs_connectors.fp8_utils", "hs_connectors.transfer")


def within_bound(deq: torch.Tensor, unq: torch.Tensor, scales: torch.Tensor) -> bool:
    """``deq`` (float32 [T, L, H]) against ``unq`` within fp8.py's bound, ``scales`` [T, 1, 1]."""
    unq = unq.float()
    return bool(((deq - unq).abs() <= torch.maximum(unq.abs() * FP8_REL, scales.expand_as(unq) * 2**-10)).all())


def fp8_tolerance(dtype: str) -> float:
    return reference.TOLERANCE[dtype] + FP8_REL


@pytest.fixture(scope="module")
def unquantized(llama_path):
    """The same prompts' states from an engine with the model's dtype (the baseline)."""
    from speculators_compat.generator import VllmHiddenStatesGenerator

    with VllmHiddenStatesGenerator(llama_path, layer_ids=LAYERS, self_check=True, **ENGINE) as g:
        return [torch.stack([h.clone() for h in r["hidden_states"]], dim=1) for r in g.generate(MIXED)]


@pytest.fixture(scope="module")
def gen8(llama_path, unquantized):
    from speculators_compat.generator import VllmHiddenStatesGenerator

    g = VllmHiddenStatesGenerator(llama_path, layer_ids=LAYERS, self_check=True, states_dtype="fp8", **ENGINE)
    yield g
    g.close()


def test_generate_fp8_is_speculators_quantization_of_the_unquantized_states(gen8, unquantized, llama_path, hf_ref):
    fp8_utils, _ = hs_connectors()
    order = list(range(len(MIXED)))[::-1]  # the same prompts reordered: each result is its prompt's
    for prompts, idx in ((MIXED, list(range(len(MIXED)))), ([MIXED[i] for i in order], order), (MIXED, None)):
        before = gen8.engine.self_check_stats.as_dict()
        res = gen8.generate(prompts)
        checked = gen8.engine.self_check_stats.since(before)
        assert checked["checked"] == len(prompts) and checked["failed"] == 0, checked
        deq = []
        for r, i in zip(res, idx or range(len(MIXED))):
            q = torch.stack(r["hidden_states"], dim=1)
            s = r["hidden_states_scales"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == unquantized[i].shape
            assert s.dtype == torch.float32 and s.shape == (len(MIXED[i]), 1)
            theirs_q, theirs_s = fp8_utils.quantize_tensor_to_fp8(unquantized[i])
            assert torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8)), f"prompt {i}: fp8 bytes differ"
            assert torch.equal(s[:, :, None], theirs_s), f"prompt {i}: scales differ"
            back = (q.float() * s[:, :, None]).float()
            assert within_bound(back, unquantized[i], s[:, :, None]), f"prompt {i}"
            deq.append([back[:, j] for j in range(len(LAYERS))])
        worst, bad = reference.compare(deq, prompts, hf_ref(llama_path, LAYERS), fp8_tolerance("bfloat16"))
        assert not bad, (worst, bad[:3])
        print(f"fp8 states vs HF: worst relative error {worst:.4f} (tolerance {fp8_tolerance('bfloat16')})")


@pytest.mark.parametrize("fault,message", [("shift", r"self-check: \d+ of"), ("nan", r"NaN/Inf hidden states")])
def test_the_checks_see_the_unquantized_rows(gen8, fault, message):
    """A shifted capture fails the self-check, a NaN row the NaN/Inf check, as without FP8."""
    from speculators_compat.errors import CaptureError

    gen8.engine.executor.collective_rpc("compat_inject_fault", args=(fault,))
    try:
        with pytest.raises(CaptureError, match=message):
            gen8.generate(MIXED)
    finally:
        gen8.engine.executor.collective_rpc("compat_inject_fault", args=(None,))
    assert len(gen8.generate(MIXED[:3])) == 3  # and the engine is right again


def test_bad_states_dtype_is_refused_before_the_engine(llama_path):
    from speculators_compat.generator import VllmHiddenStatesGenerator

    with pytest.raises(ValueError, match="states_dtype must be one of auto, fp8, not 'int8'"):
        VllmHiddenStatesGenerator(llama_path, states_dtype="int8", **ENGINE)


# -- extract ----------------------------------------------------------------------------------------
HS_LAYERS = [2, 3, 4, 6]  # vLLM's convention (--format speculators-hs)


@pytest.fixture(scope="module")
def outputs(llama_path, tmp_path_factory):
    """One input extracted four ways: speculators-hs and pt, each unquantized and FP8 (pt's FP8
    twice: thread and process writers)."""
    from speculators_compat.pipeline.extract import run_extract
    from tests.helpers import make_jsonl

    d = tmp_path_factory.mktemp("fp8")
    src = d / "in.jsonl"
    make_jsonl(src, [len(p) for p in MIXED])
    kw = dict(progress=False, batch_size=5, **ENGINE)
    runs = {}
    for name, fmt, ids, extra in (
        ("hs", "speculators-hs", HS_LAYERS, {}),
        ("hs-fp8", "speculators-hs", HS_LAYERS, {"states_dtype": "fp8"}),
        ("pt", "pt", LAYERS, {}),
        ("pt-fp8", "pt", LAYERS, {"states_dtype": "fp8", "writer": "thread"}),
        ("pt-fp8-proc", "pt", LAYERS, {"states_dtype": "fp8", "writer": "process"}),
    ):
        runs[name] = run_extract(llama_path, str(src), str(d / name), fmt=fmt, layer_ids=ids, **kw, **extra)
        runs[name]["dir"] = d / name
    return src, runs


def test_extract_speculators_hs_fp8_is_their_layout_and_arithmetic(outputs, llama_path, hf_ref):
    from safetensors.torch import load_file

    from speculators_compat.pipeline.output.verify import verify_output

    fp8_utils, transfer = hs_connectors()
    src, runs = outputs
    prompts = [json.loads(line)["input_ids"] for line in src.read_text().splitlines()]
    hs, hs8 = runs["hs"]["dir"] / "hidden_states", runs["hs-fp8"]["dir"] / "hidden_states"
    reader = transfer.FP8Transfer(hs8, dequantize_dtype=torch.float32)  # speculators' own fp8 reader
    deq = []
    for i in range(len(prompts)):
        u = load_file(hs / f"hs_{i}.safetensors")["hidden_states"]
        f = load_file(hs8 / f"hs_{i}.safetensors")
        assert set(f) == {"hidden_states", "hidden_states_scales", "token_ids"}
        q, s = fp8_utils.quantize_tensor_to_fp8(u)
        assert torch.equal(f["hidden_states"].view(torch.uint8), q.view(torch.uint8)), i
        assert torch.equal(f["hidden_states_scales"], s) and f["token_ids"].tolist() == prompts[i]
        got = reader.get_cached(i)
        assert set(got) == {"hidden_states", "token_ids"} and within_bound(got["hidden_states"], u, s), i
        deq.append([got["hidden_states"][:, j] for j in range(len(HS_LAYERS))])
    worst, bad = reference.compare(
        deq, prompts, hf_ref(llama_path, [k - 1 for k in HS_LAYERS]), fp8_tolerance("bfloat16")
    )
    assert not bad, (worst, bad[:3])
    ratio = runs["hs-fp8"]["bytes"] / runs["hs"]["bytes"]
    print(f"speculators-hs bytes, fp8 / bf16: {ratio:.3f}")
    assert 0.45 < ratio < 0.55
    assert verify_output(runs["hs-fp8"]["dir"])["ok"]
    assert json.loads((hs8 / "run.json").read_text())["states_dtype"] == "fp8"


def test_extract_pt_fp8_dequantizes_at_load_and_writers_agree(outputs):
    from speculators_compat.engine import fp8
    from speculators_compat.pipeline.output.verify import verify_output

    _, runs = outputs
    pt, pt8, proc = (runs[k]["dir"] for k in ("pt", "pt-fp8", "pt-fp8-proc"))
    assert runs["pt-fp8-proc"]["writer"] == "process" and runs["pt-fp8-proc"]["files_by_writer_processes"] > 0
    for i in range(len(MIXED)):
        name = f"data_{i}.pt"
        assert (pt8 / name).read_bytes() == (proc / name).read_bytes(), name  # thread and process writers
        u = torch.load(pt / name, weights_only=True)
        d = torch.load(pt8 / name, weights_only=True)  # (the patch is on: import speculators_compat)
        assert d["hidden_states"][0].dtype == torch.bfloat16 and len(d["hidden_states"]) == len(LAYERS)
        assert torch.equal(d["input_ids"], u["input_ids"]) and torch.equal(d["loss_mask"], u["loss_mask"])
        with fp8.raw_pt_states():
            raw = torch.load(pt8 / name, weights_only=True)["hidden_states"]
        q, s = fp8.quantize_per_token(torch.stack(u["hidden_states"], dim=1))
        assert torch.equal(torch.stack(raw.layers, 1).view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(raw.scales, s[:, :, 0])
        assert all(torch.equal(a, fp8.dequantize(b, raw.scales)) for a, b in zip(d["hidden_states"], raw.layers))
    assert runs["pt-fp8"]["bytes"] / runs["pt"]["bytes"] < 0.6
    assert verify_output(pt8)["ok"] and verify_output(proc)["ok"]


def test_resume_with_another_states_dtype_is_refused(outputs, llama_path):
    from speculators_compat.errors import OutputError
    from speculators_compat.pipeline.extract import run_extract

    src, runs = outputs
    for name, other in (("pt-fp8", "auto"), ("pt", "fp8")):
        # (every file but the output's lock, which each run that holds it rewrites)
        before = {p.name: p.stat().st_mtime_ns for p in runs[name]["dir"].iterdir() if p.name != ".lock"}
        with pytest.raises(OutputError, match=r"states_dtype: '(fp8|auto)' -> '(auto|fp8)'"):
            run_extract(
                llama_path, str(src), str(runs[name]["dir"]), layer_ids=LAYERS, states_dtype=other, progress=False
            )
        after = {p.name: p.stat().st_mtime_ns for p in runs[name]["dir"].iterdir() if p.name != ".lock"}
        assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}

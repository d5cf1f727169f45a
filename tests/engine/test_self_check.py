"""The self-check on the real engine (engine/witness.py, engine/selfcheck.py): every request's
sampled token set against the logits of its captured final-layer state.

Here the final layer (5 of the tiny Llama's 0..5) is not among the captured layers, so its row is
kept for the check alone, placed by the same plan as the captured rows. The arena path (final
layer captured) is in test_dropin.py, TP=2 in test_dropin_engines.py, the pipeline's "nothing of a
failed batch is written" in test_pipeline.py.

The faults are made in the worker (``compat_inject_fault``, a seam for tests): two requests' rows
swapped, rows zeroed, rows one position late. Each must fail the check; the same fault with the
check off returns wrong states without a word (checked against HF), which is why the check exists.
"""

import pytest

from speculators_compat import VllmHiddenStatesGenerator
from speculators_compat.errors import CaptureError
from speculators_compat.testing import models, reference

# its own engine: in the newest cell and the overlay (scripts/test.sh); the check itself
# runs in every engine test of every cell (on by default), and test_dropin.py's fault test too
pytestmark = pytest.mark.ends
TOL = reference.TOLERANCE["float32"]
LAYERS = [0, 2]
# 13 prompts, 4 a step at most, the long ones split over 128-token steps (chunked prefill)
MIXED = models.random_prompts([5, 300, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200, 3], seed=6)
# equal lengths: the swap fault exchanges two requests' rows and coverage still holds
EQUAL = models.random_prompts([24] * 12, seed=5)
FAILS = {
    "swap": r"vLLM sampled token \d+, its captured state's argmax is token \d+",
    "zero": r"all zeros",
    "shift": r"vLLM sampled token \d+, its captured state's argmax is token \d+",
}


@pytest.fixture(scope="module")
def gen(llama_path):
    g = VllmHiddenStatesGenerator(
        llama_path,
        layer_ids=LAYERS,
        max_model_len=1024,
        dtype="float32",
        max_num_batched_tokens=128,
        max_num_seqs=4,
        self_check=True,
    )
    yield g
    g.close()


def inject(g, kind):
    g.engine.executor.collective_rpc("compat_inject_fault", args=(kind,))


def wrong_rows(g, path, prompts, hf_ref) -> int:
    res = g.generate(prompts)
    _, bad = reference.compare([r["hidden_states"] for r in res], prompts, hf_ref(path, LAYERS), TOL)
    return len(bad)


def test_every_request_is_checked_and_passes(gen, llama_path, hf_ref):
    assert gen.engine.self_check
    for prompts in (MIXED, EQUAL, MIXED):  # repeated calls
        before = gen.engine.self_check_stats.as_dict()
        assert wrong_rows(gen, llama_path, prompts, hf_ref) == 0
        got = gen.engine.self_check_stats.since(before)
        assert got.pop("max_logprob_diff") <= 2 * 1e-4 * 10  # (float32: 2 x 1e-4 x |top logit|, top < 10 here)
        assert got == {
            "checked": len(prompts),
            "failed": 0,
            "near_ties": 0,
            "max_gap": 0.0,
            "values_checked": len(prompts),  # vLLM's log-probabilities came back and matched ours
        }
    assert gen.engine.stats()["self_check_s"] > 0  # it ran in the worker


def test_the_prompts_give_distinct_tokens(llama_path):
    """What makes the swap fault visible here: the two swapped requests' greedy tokens differ
    (HF's own next token at each prompt's last position)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(llama_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        nxt = m(torch.tensor(EQUAL)).logits[:, -1].argmax(-1).tolist()
    assert len(set(nxt[:4])) == 4, nxt


@pytest.mark.parametrize("fault", sorted(FAILS))
def test_a_wrong_capture_fails_the_check(gen, llama_path, hf_ref, fault):
    prompts = EQUAL if fault == "swap" else MIXED
    inject(gen, fault)
    try:
        with pytest.raises(CaptureError, match=r"self-check: \d+ of \d+ prompts.*prompt \d+ \(request sc-[^)]+\): "):
            gen.generate(prompts)
        with pytest.raises(CaptureError, match=FAILS[fault]):
            gen.generate(prompts)
        gen.engine.self_check = False  # the same fault unchecked: wrong states, no error
        assert wrong_rows(gen, llama_path, prompts, hf_ref) > 0
    finally:
        gen.engine.self_check = True
        inject(gen, None)
    assert wrong_rows(gen, llama_path, prompts, hf_ref) == 0  # and the engine is right again


def test_the_drop_in_leaves_it_off_unless_asked(llama_path, monkeypatch):
    """Off by default in the drop-in (it costs ~1% on an H200: docs/benchmarks.md), on with
    SPECULATORS_COMPAT_SELF_CHECK=1; `extract` turns it on (test_pipeline.py)."""
    with VllmHiddenStatesGenerator(llama_path, layer_ids=LAYERS, max_model_len=256, dtype="float32") as g:
        g.generate(EQUAL[:3])
        assert not g.engine.self_check and g.engine.self_check_stats.checked == 0
        assert g.engine.stats()["self_check_s"] == 0
    monkeypatch.setenv("SPECULATORS_COMPAT_SELF_CHECK", "1")
    with VllmHiddenStatesGenerator(llama_path, layer_ids=LAYERS, max_model_len=256, dtype="float32") as g:
        g.generate(EQUAL[:3])
        assert g.engine.self_check and g.engine.self_check_stats.checked == 3


# -- the blind spot of the argmax: rows from elsewhere whose next token is the same -------------
def _hf_next(llama_path, prompts, at=-1):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(llama_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [m(torch.tensor([p])).logits[0, at].argmax().item() for p in prompts]


@pytest.fixture(scope="module")
def same_next_pair(llama_path):
    """Two 24-token prompts whose next token (HF's greedy choice) is the same, found by search, with
    three of other lengths (the swap fault exchanges the first two rows of equal length in a step,
    so only the pair is swapped)."""
    cands = models.random_prompts([24] * 64, seed=11)
    nxt = _hf_next(llama_path, cands)
    by = {}
    for p, t in zip(cands, nxt):
        by.setdefault(t, []).append(p)
    pair = next(ps[:2] for ps in by.values() if len(ps) >= 2)
    return pair + models.random_prompts([7, 40, 13], seed=12)


@pytest.fixture(scope="module")
def repeated_suffix(llama_path):
    """Prompts ending in a run of one repeated token, chosen so that HF's next token after the last
    position and after the one before are the same: a one-position shift keeps the argmax."""
    out = []
    for seed in range(200):
        (head,) = models.random_prompts([20 + seed % 7], seed=100 + seed)
        p = head + [head[-1]] * 6
        a, b = _hf_next(llama_path, [p, p], at=-1)[0], _hf_next(llama_path, [p], at=-2)[0]
        if a == b:
            out.append(p)
        if len(out) == 4:
            return out
    pytest.fail("no prompt with a repeated-token suffix kept its next token over one position")


@pytest.mark.parametrize("fault", ["swap", "shift"])
def test_a_wrong_row_with_the_same_next_token_fails_by_value(
    gen, llama_path, hf_ref, same_next_pair, repeated_suffix, fault
):
    prompts = same_next_pair if fault == "swap" else repeated_suffix
    if fault == "swap":  # precondition: the argmax cannot tell the swapped rows apart
        a, b = _hf_next(llama_path, prompts[:2])
        assert a == b
    inject(gen, fault)
    try:
        with pytest.raises(CaptureError, match=r"vLLM gave token \d+ log-probability .* same sampled token") as e:
            gen.generate(prompts)
        assert "argmax is token" not in str(e.value)  # the values caught it, not the argmax
        gen.engine.self_check = False  # unchecked: states HF rejects, without a word
        assert wrong_rows(gen, llama_path, prompts, hf_ref) > 0
    finally:
        gen.engine.self_check = True
        inject(gen, None)
    assert wrong_rows(gen, llama_path, prompts, hf_ref) == 0

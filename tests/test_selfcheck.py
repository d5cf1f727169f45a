"""The self-check's verdict (engine/selfcheck.py): which sampled tokens pass, which are near-ties,
which fail and what the failure says. Pure logic over the worker's top logits; the real engine's
side is tests/engine/test_self_check.py."""

import pytest

from speculators_compat.engine.selfcheck import REL_TOL, SelfCheckStats, judge, tolerance


def verdict(*rows, zero=None, problems=None):
    n = len(rows)
    return {
        "ids": [list(r[0]) for r in rows],
        "logits": [list(r[1]) for r in rows],
        "zero": zero or [False] * n,
        "problems": problems or [None] * n,
    }


def tok(t, ids=(), vals=()):
    """What the engine hands judge() for a request: vLLM's token, its reported ids and log-probabilities."""
    return (t, list(ids), list(vals))


TOP = ([7, 3, 9], [12.0, 11.99, 4.0])  # token 3 within bf16's tolerance of 7; 9 far below


def test_the_argmax_passes_with_no_gap():
    st = SelfCheckStats()
    assert judge(["a", "b"], verdict(TOP, TOP), {"a": tok(7), "b": tok(7)}, "bfloat16", st) == []
    assert st.as_dict() == {
        "checked": 2,
        "failed": 0,
        "near_ties": 0,
        "max_gap": 0.0,
        "values_checked": 0,  # (vLLM reported no log-probabilities here)
        "max_logprob_diff": 0.0,
    }


def test_a_near_tie_is_counted_not_failed():
    st = SelfCheckStats()
    assert judge(["a"], verdict(TOP), {"a": tok(3)}, "bfloat16", st) == []
    assert st.near_ties == 1 and st.failed == 0 and st.max_gap == pytest.approx(0.01)
    # the same gap is far outside float32's tolerance: there it fails
    st32 = SelfCheckStats()
    (line,) = judge(["a"], verdict(TOP), {"a": tok(3)}, "float32", st32)
    assert "vLLM sampled token 3" in line and "argmax is token 7" in line and "logit gap 0.01" in line
    assert st32.failed == 1


def test_a_token_outside_the_top_logits_fails_naming_the_prompt():
    st = SelfCheckStats()
    (line,) = judge(["x", "y"], verdict(TOP, TOP), {"x": tok(7), "y": tok(500)}, "bfloat16", st)
    assert line.startswith("prompt 1 (request y): vLLM sampled token 500")
    assert "not among our top 3: logit gap > 8" in line
    assert st.as_dict()["failed"] == 1 and st.checked == 2


def test_a_gap_beyond_the_tolerance_fails():
    st = SelfCheckStats()
    (line,) = judge(["a"], verdict(TOP), {"a": tok(9)}, "bfloat16", st)
    assert "logit gap 8" in line and f"tolerance {tolerance('bfloat16', 12.0):.3g}" in line


def test_zeros_a_missing_token_and_a_missing_row_fail():
    st = SelfCheckStats()
    lines = judge(
        ["a", "b", "c"],
        verdict(TOP, TOP, TOP, zero=[True, False, False], problems=[None, None, "no captured state"]),
        {"a": tok(7)},
        "bfloat16",
        st,
    )
    assert "all zeros" in lines[0]  # even though token 7 is "our argmax": zeros imply nothing
    assert lines[1].startswith("prompt 1 (request b)") and "returned no sampled token" in lines[1]
    assert lines[2].startswith("prompt 2 (request c)") and "no captured state" in lines[2]
    assert st.failed == 3


def test_tolerance_scales_with_the_top_logit_and_the_dtype():
    assert tolerance("bfloat16", 0.1) == REL_TOL["bfloat16"]  # at least 1 x the relative margin
    assert tolerance("bfloat16", -40.0) == pytest.approx(40 * 2**-5)
    assert tolerance("float32", 40.0) < tolerance("float16", 40.0) < tolerance("bfloat16", 40.0)


def test_since_gives_a_runs_own_counts():
    st = SelfCheckStats(checked=10, failed=1, near_ties=2, max_gap=0.5)
    before = st.as_dict()
    judge(["a"], verdict(TOP), {"a": tok(3)}, "bfloat16", st)
    assert st.since(before) == {
        "checked": 1,
        "failed": 0,
        "near_ties": 1,
        "max_gap": 0.5,
        "values_checked": 0,
        "max_logprob_diff": 0.0,
    }


# -- the values: vLLM's log-probabilities of its top tokens against ours at the same ids ------------
LP_IDS, LP_VLLM = [7, 7, 3, 9], [-0.70, -0.70, -0.71, -8.7]  # (the sampled token first, then the top ones)


def test_log_probabilities_within_the_tolerance_pass_and_are_counted():
    st = SelfCheckStats()
    v = verdict(TOP)
    v["logprobs"] = [[-0.701, -0.701, -0.709, -8.69]]
    assert judge(["a"], v, {"a": tok(7, LP_IDS, LP_VLLM)}, "bfloat16", st) == []
    assert st.values_checked == 1 and st.max_logprob_diff == pytest.approx(0.01)


def test_the_same_argmax_with_another_distribution_fails():
    """Two prompts whose next token is the same: the argmax passes, the values do not."""
    st = SelfCheckStats()
    v = verdict(TOP)
    v["logprobs"] = [[-2.1, -2.1, -2.3, -3.0]]  # token 7 still on top, at another probability
    (line,) = judge(["a"], v, {"a": tok(7, LP_IDS, LP_VLLM)}, "bfloat16", st)
    tol = 2 * tolerance("bfloat16", 12.0)
    assert line.startswith("prompt 0 (request a): vLLM gave token 9 log-probability -8.7")
    assert "its captured state gives -3" in line and f"tolerance {tol:.3g}" in line
    assert "same sampled token 7" in line and line.endswith("the state is not this request's")
    assert st.failed == 1 and st.values_checked == 0


def test_the_tolerance_for_log_probabilities_is_twice_the_logits():
    """A log-probability is a logit less the log-sum-exp, which moves no more than the largest
    logit: a difference just inside 2 x the logit tolerance passes, just outside fails."""
    tol = tolerance("float32", 12.0)
    for d, ok in ((1.9 * tol, True), (2.1 * tol, False)):
        v = verdict(TOP)
        v["logprobs"] = [[-0.70 + d, -0.70 + d, -0.71, -8.7]]
        assert (judge(["a"], v, {"a": tok(7, LP_IDS, LP_VLLM)}, "float32", SelfCheckStats()) == []) is ok

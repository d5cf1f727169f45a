"""The self-check, driver side: the token vLLM sampled for each request, and the log-probabilities
vLLM gave its top tokens, against what our captured state implies (computed in the workers:
witness.py).

vLLM attributes each sampled token to a request by its own request id; we attribute each captured
row by ours (attribution.py). Greedy sampling takes the argmax of the logits at the request's last
prompt position, so if our final-layer row there is the one vLLM computed, the final norm and
lm_head applied to it give back that argmax, up to rounding. The argmax alone passes a row taken
from another request or position whose next token happens to be the same, which real data makes
common (rows ending in the same end-of-turn token). So the values are compared too: vLLM reports
the log-probabilities of its sampled token and its top LOGPROBS tokens (computed in float32 from
the logits it sampled from), and ours at the same token ids must agree within the tolerance. Two
prompts with the same next token almost never have the same distribution over the next token.

What it cannot see: a wrong value in a layer other than the last, when the rows are placed right
(every captured layer is placed by the same plan as the checked row, so a misplacement shows; a
corrupted middle layer alone does not), and a perturbation too small to move the log-probabilities
by more than the tolerance.

Tolerance: our logits and vLLM's come from the same weights and kernels but not bit-identical
inputs (we hold ``hidden + residual`` rounded to the model's dtype; vLLM's fused add-and-norm
sums in float32) and each ends in a rounding to that dtype. A sampled token that is not our
argmax but whose logit is within ``REL_TOL[dtype] * max(1, |top logit|)`` of it is a near-tie:
counted and reported, not failed. bfloat16 keeps 8 significant bits (a rounding moves a value by
up to 2^-9 of it), so 2^-5 is 16 such roundings: room for the two outputs' roundings and the
input's, with the rest for the lm_head's sum, where terms cancel. float16 has 11 bits (2^-8),
float32 24 (1e-4, far above its rounding: the kernels differ with the batch's shape). A
log-probability is a logit less the log-sum-exp of all of them, and the log-sum-exp moves by no
more than the largest logit error: so two log-probabilities may differ by twice the logit tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

REL_TOL = {"bfloat16": 2**-5, "float16": 2**-8, "float32": 1e-4}
LOGPROBS = 8  # vLLM's top tokens whose log-probabilities come back with the sampled one

# what ``speculators-compat doctor`` says of it
PROVES = (
    "every request's final-layer state at its last position gives back the token vLLM sampled for "
    "that request and the log-probabilities vLLM gave its top tokens (its final norm and lm_head, in "
    "the workers): a state swapped between requests, shifted in position, or zeros fails the batch "
    "before it is returned or written, also when both requests' next tokens are the same"
)
CANNOT = (
    "a wrong value in a layer other than the last when rows are placed right (all layers share the "
    "checked row's placement), or a change too small to move the log-probabilities beyond the "
    "tolerance"
)


def tolerance(dtype: str, top: float) -> float:
    return REL_TOL.get(dtype, REL_TOL["bfloat16"]) * max(1.0, abs(top))


def first_logprobs(lists) -> tuple[list[int], list[float]]:
    """(token ids, log-probabilities) vLLM reported for a request's first sampled token (its
    ``EngineCoreOutput.new_logprobs``: the sampled token first, then the top ones); empty when it
    reported none."""
    if lists is None or len(lists.logprob_token_ids) == 0:
        return [], []
    return [int(t) for t in lists.logprob_token_ids[0]], [float(v) for v in lists.logprobs[0]]


@dataclass
class SelfCheckStats:
    checked: int = 0  # requests whose sampled token was set against their state
    failed: int = 0
    near_ties: int = 0  # sampled token not our argmax, but within the tolerance
    max_gap: float = 0.0  # largest (our top logit - our logit of the sampled token) that passed
    values_checked: int = 0  # requests whose log-probabilities were set against vLLM's
    max_logprob_diff: float = 0.0  # largest |ours - vLLM's| over those that passed

    def as_dict(self) -> dict:
        return {
            "checked": self.checked,
            "failed": self.failed,
            "near_ties": self.near_ties,
            "max_gap": round(self.max_gap, 6),
            "values_checked": self.values_checked,
            "max_logprob_diff": round(self.max_logprob_diff, 6),
        }

    def since(self, before: dict) -> dict:
        """What was counted after ``before`` (an earlier as_dict()): a pipeline run's own share."""
        now = self.as_dict()
        out = {k: now[k] - before.get(k, 0) for k in ("checked", "failed", "near_ties", "values_checked")}
        for k in ("max_gap", "max_logprob_diff"):  # (not sums: the engine's largest so far)
            out[k] = now[k]
        return out


def judge(ids: list[str], verdict: dict, sampled: dict, dtype: str, stats: SelfCheckStats) -> list[str]:
    """Count every request in ``ids`` into ``stats``; return one line for each that failed.
    ``sampled``: request id -> (token, vLLM's token ids, its log-probabilities) (``_drive``)."""
    failures = []
    ours_lp = verdict.get("logprobs") or [None] * len(ids)
    for i, rid in enumerate(ids):
        top_ids, top_logits = verdict["ids"][i], verdict["logits"][i]
        problem = verdict["problems"][i]
        token, lp_ids, lp_vals = sampled.get(rid) or (None, [], [])
        stats.checked += 1
        head = f"prompt {i} (request {rid})"
        if problem is not None:
            failures.append(f"{head}: {problem}")
        elif verdict["zero"][i]:
            failures.append(f"{head}: its captured final-layer state at the last position is all zeros")
        elif token is None:
            failures.append(f"{head}: the engine returned no sampled token for it")
        else:
            tol = tolerance(dtype, top_logits[0])
            why = _argmax_problem(token, top_ids, top_logits, tol, stats)
            why = why or _logprob_problem(lp_ids, lp_vals, ours_lp[i], 2 * tol, stats)
            if why:
                failures.append(f"{head}: {why}: the state is not this request's")
    stats.failed += len(failures)
    return failures


def _argmax_problem(token, top_ids, top_logits, tol, stats) -> str | None:
    """Why our top logits do not give vLLM's sampled ``token`` (None: they do, a near-tie counted)."""
    if token in top_ids:
        gap = top_logits[0] - top_logits[top_ids.index(token)]
        if gap <= tol:
            stats.near_ties += token != top_ids[0]
            stats.max_gap = max(stats.max_gap, gap)
            return None
        what = f"logit gap {gap:.4g}"
    else:
        what = f"not among our top {len(top_ids)}: logit gap > {top_logits[0] - top_logits[-1]:.4g}"
    return (
        f"vLLM sampled token {token}, its captured state's argmax is token {top_ids[0]} ({what}, tolerance {tol:.3g})"
    )


def _logprob_problem(lp_ids, lp_vals, ours, tol, stats) -> str | None:
    """Why our log-probabilities at vLLM's reported token ids differ from vLLM's (None: they agree,
    or vLLM reported none)."""
    if not lp_ids or ours is None or len(ours) != len(lp_ids):
        return None
    diffs = [abs(a - b) for a, b in zip(ours, lp_vals)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    if diffs[worst] > tol:
        return (
            f"vLLM gave token {lp_ids[worst]} log-probability {lp_vals[worst]:.6g}, its captured state "
            f"gives {ours[worst]:.6g} (difference {diffs[worst]:.4g}, tolerance {tol:.3g}; same sampled "
            f"token {lp_ids[0]})"
        )
    stats.values_checked += 1
    stats.max_logprob_diff = max(stats.max_logprob_diff, diffs[worst])
    return None

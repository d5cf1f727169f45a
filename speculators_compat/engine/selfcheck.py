"""The self-check, driver side: the token vLLM sampled for each request against the logits our
captured state implies (computed in the workers: witness.py).

vLLM attributes each sampled token to a request by its own request id; we attribute each captured
row by ours (attribution.py). Greedy sampling takes the argmax of the logits at the request's last
prompt position, so if our final-layer row there is the one vLLM computed, the final norm and
lm_head applied to it give back that argmax, up to rounding. A row taken from another request or
position, or zeros, gives another token, almost always: a misplaced row passes only when both
positions' next tokens happen to be the same.

What it cannot see: a wrong value in a layer other than the last, when the rows are placed right
(every captured layer is placed by the same plan as the checked row, so a misplacement shows; a
corrupted middle layer alone does not), and a perturbation too small to move the argmax.

Tolerance: our logits and vLLM's come from the same weights and kernels but not bit-identical
inputs (we hold ``hidden + residual`` rounded to the model's dtype; vLLM's fused add-and-norm
sums in float32) and each ends in a rounding to that dtype. A sampled token that is not our
argmax but whose logit is within ``REL_TOL[dtype] * max(1, |top logit|)`` of it is a near-tie:
counted and reported, not failed. bfloat16 keeps 8 significant bits (a rounding moves a value by
up to 2^-9 of it), so 2^-5 is 16 such roundings: room for the two outputs' roundings and the
input's, with the rest for the lm_head's sum, where terms cancel. float16 has 11 bits (2^-8),
float32 24 (1e-4, far above its rounding: the kernels differ with the batch's shape).
"""

from __future__ import annotations

from dataclasses import dataclass

REL_TOL = {"bfloat16": 2**-5, "float16": 2**-8, "float32": 1e-4}

# what ``speculators-compat doctor`` says of it
PROVES = (
    "every request's final-layer state at its last position gives back the token vLLM sampled for "
    "that request (its final norm and lm_head, in the workers): a state swapped between requests, "
    "shifted in position, or zeros fails the batch before it is returned or written"
)
CANNOT = (
    "a wrong value in a layer other than the last when rows are placed right (all layers share the "
    "checked row's placement), a change too small to move the argmax, or two requests' rows swapped "
    "when their next tokens are the same"
)


def tolerance(dtype: str, top: float) -> float:
    return REL_TOL.get(dtype, REL_TOL["bfloat16"]) * max(1.0, abs(top))


@dataclass
class SelfCheckStats:
    checked: int = 0  # requests whose sampled token was set against their state
    failed: int = 0
    near_ties: int = 0  # sampled token not our argmax, but within the tolerance
    max_gap: float = 0.0  # largest (our top logit - our logit of the sampled token) that passed

    def as_dict(self) -> dict:
        return {
            "checked": self.checked,
            "failed": self.failed,
            "near_ties": self.near_ties,
            "max_gap": round(self.max_gap, 6),
        }

    def since(self, before: dict) -> dict:
        """What was counted after ``before`` (an earlier as_dict()): a pipeline run's own share."""
        now = self.as_dict()
        out = {k: now[k] - before.get(k, 0) for k in ("checked", "failed", "near_ties")}
        out["max_gap"] = now["max_gap"]  # (not a sum: the engine's largest so far)
        return out


def judge(ids: list[str], verdict: dict, sampled: dict, dtype: str, stats: SelfCheckStats) -> list[str]:
    """Count every request in ``ids`` into ``stats``; return one line for each that failed."""
    failures = []
    for i, rid in enumerate(ids):
        top_ids, top_logits = verdict["ids"][i], verdict["logits"][i]
        problem = verdict["problems"][i]
        token = sampled.get(rid)
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
            if token in top_ids:
                gap = top_logits[0] - top_logits[top_ids.index(token)]
                if gap <= tol:
                    stats.near_ties += token != top_ids[0]
                    stats.max_gap = max(stats.max_gap, gap)
                    continue
                what = f"logit gap {gap:.4g}"
            else:
                what = f"not among our top {len(top_ids)}: logit gap > {top_logits[0] - top_logits[-1]:.4g}"
            failures.append(
                f"{head}: vLLM sampled token {token}, its captured state's argmax is token {top_ids[0]} "
                f"({what}, tolerance {tol:.3g}): the state is not this request's"
            )
    stats.failed += len(failures)
    return failures

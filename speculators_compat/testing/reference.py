"""Hugging Face transformers reference: per sequence and per layer id L, the output of decoder
layer L (residual stream, before the final norm), in float32.

HF's ``output_hidden_states[L + 1]`` is that value for L < n-1, but its last entry is *after* the
final norm, so we read every layer with a forward hook on ``model.model.layers[L]`` instead.

Tolerances (relative Frobenius error ||a - b|| / ||b|| per sequence and layer):
  * float32 engine vs float32 HF: 1e-3. Measured ~1e-6 on the tiny models; the margin covers
    different matmul/attention kernels. A misattributed or shifted row gives ~1.
  * bfloat16 engine vs float32 HF: 6e-2. bf16 has an 8-bit mantissa (unit roundoff 2^-8 = 3.9e-3),
    and rounding compounds through the residual stream; measured 1.2e-2 .. 2.8e-2 over 6 layers of
    the random tiny models (RUNTIME.md §4 and our runs). A wrong row is still ~1, 20x above.
  * float16: 2e-2.
"""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = {"float32": 1e-3, "bfloat16": 6e-2, "float16": 2e-2}


def tolerance_for(dtype) -> float:
    name = str(dtype).replace("torch.", "")
    return TOLERANCE[name]


class HFReference:
    """Runs an HF model in float32, one sequence at a time, caching results by token tuple."""

    def __init__(self, model_path, layer_ids, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        self.layer_ids = list(layer_ids)
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).to(device)
        self.model.eval()
        self._cache: dict[tuple, list] = {}
        base = self.model.model
        self._captured: dict[int, object] = {}
        for lid in set(self.layer_ids):  # (id len(layers): the final state, the norm's output)
            module = base.norm if lid == len(base.layers) else base.layers[lid]
            module.register_forward_hook(self._hook(lid))

    def _hook(self, lid):
        def hook(module, args, output):
            self._captured[lid] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    def __call__(self, ids) -> list:
        import torch

        key = tuple(ids)
        if key not in self._cache:
            self._captured.clear()
            with torch.no_grad():
                self.model(torch.tensor([list(ids)], device=self.device), use_cache=False)
            self._cache[key] = [self._captured[lid][0].float().cpu() for lid in self.layer_ids]
        return self._cache[key]


@dataclass
class Mismatch:
    seq: int
    layer: int
    max_abs: float
    rel: float
    shape: tuple


def compare(results, prompts, reference: HFReference, tol: float, layer_ids=None):
    """Compare engine results (list of per-layer tensor lists) with the reference, per sequence/layer.

    Returns (worst relative error, list of Mismatch beyond ``tol``); a shape or length mismatch is
    reported with rel=inf.
    """

    layer_ids = list(layer_ids or reference.layer_ids)
    worst, bad = 0.0, []
    if len(results) != len(prompts):
        return float("inf"), [Mismatch(-1, -1, float("inf"), float("inf"), (len(results), len(prompts)))]
    for i, (layers, ids) in enumerate(zip(results, prompts)):
        ref = reference(ids)
        for j, lid in enumerate(layer_ids):
            got = layers[j].float().cpu()
            want = ref[reference.layer_ids.index(lid)]
            if tuple(got.shape) != tuple(want.shape):
                bad.append(Mismatch(i, lid, float("inf"), float("inf"), tuple(got.shape)))
                worst = float("inf")
                continue
            diff = got - want
            rel = float(diff.norm() / want.norm().clamp_min(1e-12))
            worst = max(worst, rel)
            if not rel <= tol:
                bad.append(Mismatch(i, lid, float(diff.abs().max()), rel, tuple(got.shape)))
    return worst, bad


def check_results(results, prompts, reference: HFReference, tol: float) -> float:
    """Assert that ``results`` (``generate()``'s dicts) come in the prompts' order, each with one
    state per reference layer, and that every layer of every sequence is within ``tol`` of HF;
    returns the worst relative error."""
    assert len(results) == len(prompts), (len(results), len(prompts))
    for r, p in zip(results, prompts):  # input order
        assert r["input_ids"].tolist() == p
        assert len(r["hidden_states"]) == len(reference.layer_ids)
    worst, bad = compare([r["hidden_states"] for r in results], prompts, reference, tol)
    assert not bad, f"worst rel err {worst}; mismatches: {bad[:5]}"
    return worst

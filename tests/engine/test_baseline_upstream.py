"""What UNMODIFIED speculators 0.3.0 does on the installed vLLM (our patches disabled).

These are the "without the patch it breaks" halves of the generator patch's tests, and they tell us
when a vLLM release changes the failure. The only help upstream gets is a stand-in for its one
CUDA-only call (``torch.cuda.mem_get_info``) on this GPU-less machine.
"""

import sys

import pytest
from packaging.specifiers import SpecifierSet

from tests.helpers import run_snippet

# First failure of upstream's generator, per vLLM range (measured; see docs/compatibility.md).
EXPECTED = [
    # vLLM 0.11 (upstream's own version): runs, right for small batches, but a batch spanning two
    # scheduler steps (> 8192 prompt tokens) comes back with states swapped between requests.
    (">=0.11,<0.12", "wrong", None),
    # 0.12 - 0.23: SchedulerConfig gained the required InitVar is_encoder_decoder.
    (">=0.12,<0.24", "init", "is_encoder_decoder"),
    # 0.24+ requires transformers 5 (and 0.21+ may resolve to it), under which speculators 0.3.0
    # cannot be imported: see expectation().
]

SNIPPET = r"""
import torch
if not torch.cuda.is_available():
    torch.cuda.mem_get_info = lambda *a: (4 << 30, 8 << 30)  # stand-in for the CUDA-only call
from speculators_compat.testing import models, reference
path = str(models.build("llama"))
try:
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
except Exception as e:
    emit({"stage": "import", "error": f"{type(e).__name__}: {e}"}); return
layers = [1, 3, 5]
try:
    gen = VllmHiddenStatesGenerator(path, layer_ids=layers, max_model_len=2048)
except Exception as e:
    emit({"stage": "init", "error": f"{type(e).__name__}: {e}"}); return
ref = reference.HFReference(path, layers)
out = {"stage": "ran"}
for name, lengths in (("small", [5, 37, 120, 300, 17, 64, 8, 50, 99, 10, 11, 200, 33]),
                      ("multistep", [900] * 11)):
    prompts = models.random_prompts(lengths, seed=len(lengths))
    try:
        res = gen.generate(prompts)
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}; continue
    worst, bad = reference.compare([r["hidden_states"] for r in res], prompts, ref, 6e-2)
    swapped = []
    for b in bad:
        for j, other in enumerate(prompts):
            if j != b.seq and len(other) == len(prompts[b.seq]):
                w, bb = reference.compare([res[b.seq]["hidden_states"]], [other], ref, 6e-2)
                if not bb:
                    swapped.append([b.seq, j])
    out[name] = {"worst": worst, "bad_seqs": sorted({b.seq for b in bad}), "matches_other": swapped}
emit(out)
"""


def expectation(version):
    """What upstream's first failure must be, given vLLM's version and the installed transformers."""
    import importlib.util

    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).major >= 5:
        # speculators 0.3.0 cannot even be imported: which error comes first depends on transformers
        name = "transformers.modeling_attn_mask_utils"
        mod = sys.modules.get(name)
        if getattr(mod, "_self_speculators_compat", None) or (mod is None and importlib.util.find_spec(name) is None):
            # transformers itself lacks the module (e.g. 5.24); in this process our shim stands in
            return "import", "No module named 'transformers.modeling_attn_mask_utils'"
        return "import", "name 'torch' is not defined"  # e.g. 5.17-5.19
    for spec, kind, text in EXPECTED:
        if SpecifierSet(spec).contains(version, prereleases=True):
            return kind, text
    return None, None


def test_unmodified_upstream_fails_as_measured(vllm_version):
    result, log = run_snippet(SNIPPET, env={"SPECULATORS_COMPAT_DISABLE": "1"})
    assert result is not None, f"snippet crashed:\n{log}"
    kind, text = expectation(vllm_version)
    print(f"vLLM {vllm_version}: upstream -> {result}")
    import json
    import os

    if os.environ.get("SPECULATORS_COMPAT_RESULTS"):  # the sweep records what upstream did
        with open(os.path.join(os.environ["SPECULATORS_COMPAT_RESULTS"], f"baseline-{vllm_version}.json"), "w") as f:
            json.dump(result, f)
    if kind is None:
        pytest.fail(f"no recorded expectation for vLLM {vllm_version}; upstream did: {result}")
    if kind in ("import", "init"):
        assert result["stage"] == kind, result
        assert text in result["error"], result
    else:
        assert result["stage"] == "ran", result
        assert result["small"]["bad_seqs"] == [], result  # right when one step holds the batch
        multi = result["multistep"]
        assert multi.get("bad_seqs"), f"expected silently wrong rows for the two-step batch: {result}"
        # the wrong ones are another request's states, not noise
        assert multi["matches_other"], result

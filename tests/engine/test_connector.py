"""The capture connector under vLLM's own ``LLM(...)`` (connector/), no speculative config: every
file HF-right per sequence and layer (float32: 1e-3), for a batch over 10 prompts split over steps
(64-token chunked prefill), again reversed; with ``include_output_tokens`` the prompt and the first
max_tokens - 1 generated tokens, their greedy tokens those of vLLM without the connector; each
request self-checked against vLLM's own log-probabilities (sampling at temperature 1), a shifted
capture failing it with no file and no lock left; prefix caching refused by name."""

from __future__ import annotations

import os

import pytest
from packaging.version import Version

from speculators_compat.testing import models, reference
from tests.helpers import run_snippet

LAYERS = [2, 3, 6, 7]  # vLLM's ids (the output of k layers; 7: the final state after the norm)
PROMPTS = models.random_prompts([5, 100, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200, 3], seed=3)
GREEDY = PROMPTS[:4]
ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # (collective_rpc with our functions: tests only)

ENGINE = """
from vllm import LLM, SamplingParams
from speculators_compat.connector.worker import capture_stats, inject_fault
hs, prompts, greedy, connector, extra = {hs!r}, {prompts!r}, {greedy!r}, {connector!r}, {extra!r}
kw = dict(dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=512,
          max_num_batched_tokens=64)
kw.update(extra)
if connector:
    kw["kv_transfer_config"] = {{"kv_connector": "CaptureConnector",
        "kv_connector_module_path": "speculators_compat.connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {{"shared_storage_path": hs, "layer_ids": {layers!r}}}}}
try:
    llm = LLM({model!r}, **kw)
except Exception as e:
    emit({{"error": f"{{type(e).__name__}}: {{e}}"}})
    return
out = {{}}
def run(ps, sp):
    res = llm.generate([{{"prompt_token_ids": p}} for p in ps], sp)
    return [[(r.kv_transfer_params or {{}}).get("hidden_states_path"), list(r.outputs[0].token_ids)] for r in res]
outputs = {{"include_output_tokens": True}}
out["greedy"] = run(greedy, SamplingParams(max_tokens=8, temperature=0.0,
                    extra_args={{"kv_transfer_params": outputs}} if connector else None))
if connector:
    out["sampled"] = run(prompts, SamplingParams(max_tokens=1, temperature=1.0))
    out["reversed"] = run(prompts[::-1], SamplingParams(max_tokens=1, temperature=1.0))
    out["stats"] = llm.collective_rpc(capture_stats)[0]["self_check"]
    llm.collective_rpc(inject_fault, args=("shift",))
    out["shifted"] = run(prompts[:3], SamplingParams(max_tokens=1))
    import time; time.sleep(1)
    out["after_fault"] = llm.collective_rpc(capture_stats)[0]["self_check"]
emit(out)
"""


def engine(model: str, hs, connector=True, prompts=PROMPTS, **extra):
    body = ENGINE.format(
        hs=str(hs), prompts=prompts, greedy=GREEDY, connector=connector, extra=extra, layers=LAYERS, model=model
    )
    out, log = run_snippet(body, env=ENV, timeout=600)
    assert out is not None, log[-4000:]
    return out, log


@pytest.fixture(scope="module")
def needs_018(vllm_version):
    if vllm_version < Version("0.18"):
        pytest.skip("the connector runs where speculators >= 0.5 does: vLLM 0.18+")


@pytest.fixture(scope="module")
def run(needs_018, llama_path, tmp_path_factory):
    hs = tmp_path_factory.mktemp("connector-hs")
    out, log = engine(llama_path, hs)
    return out, hs, log


def _states(paths):
    from safetensors.torch import load_file

    files = [load_file(p) for p in paths]
    return files, [[f["hidden_states"][:, j] for j in range(len(LAYERS))] for f in files]


def test_prefill_states_are_hf_right_in_any_order(run, llama_path, hf_ref):
    out, hs, _ = run
    ref = hf_ref(llama_path, [k - 1 for k in LAYERS])
    for key, prompts in (("sampled", PROMPTS), ("reversed", PROMPTS[::-1])):
        paths = [p for p, _ in out[key]]
        files, states = _states(paths)
        assert [f["token_ids"].tolist() for f in files] == prompts
        worst, bad = reference.compare(states, prompts, ref, 1e-3)
        assert not bad, (key, worst, bad[:3])
    # every request set against vLLM's own log-probabilities at its last prompt position
    assert out["stats"]["checked"] == out["stats"]["values_checked"] == 2 * len(PROMPTS) + len(GREEDY)
    assert out["stats"]["failed"] == 0


def test_output_tokens_are_captured_and_greedy_tokens_are_unchanged(run, llama_path, hf_ref, tmp_path):
    out, hs, _ = run
    plain, _ = engine(llama_path, tmp_path, connector=False)
    assert [toks for _, toks in out["greedy"]] == [toks for _, toks in plain["greedy"]]
    files, states = _states([p for p, _ in out["greedy"]])
    seqs = [p + toks[:-1] for p, (_, toks) in zip(GREEDY, out["greedy"])]
    assert all(len(toks) == 8 for _, toks in out["greedy"])
    assert [f["token_ids"].tolist() for f in files] == seqs
    worst, bad = reference.compare(states, seqs, hf_ref(llama_path, [k - 1 for k in LAYERS]), 1e-3)
    assert not bad, (worst, bad[:3])


def test_a_shifted_capture_fails_its_self_check_and_leaves_nothing(run):
    out, hs, _ = run
    assert out["after_fault"]["failed"] == 3
    for path, _ in out["shifted"]:
        assert path is not None and not os.path.exists(path) and not os.path.exists(path + ".lock")


def test_prefix_caching_is_refused_by_name(needs_018, llama_path, tmp_path):
    out, log = engine(llama_path, tmp_path, prompts=PROMPTS[:1], enable_prefix_caching=True)
    assert "error" in out, out
    assert "prefix caching is on" in log and "--no-enable-prefix-caching" in log, log[-3000:]

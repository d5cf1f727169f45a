"""The registry's life cycle on a synthetic target module: apply on import (before and after the
hook), never double-wrap, unpatch restores the identical originals, re-patch, version gates,
feature probes, and a missing target reported (not silent)."""

import logging
import sys
import types

import pytest
import wrapt

from speculators_compat import hooks, patches, registry, versions
from speculators_compat.registry import Patch


def make_module(name):
    mod = types.ModuleType(name)

    class Thing:
        def method(self, x):
            return x + 1

    def func(x):
        return x * 2

    mod.Thing, mod.func = Thing, func
    return mod


class FakePatch(Patch):
    name = "fake"
    module = "sc_fake_target"
    targets = ("sc_fake_target:Thing.method", "sc_fake_target:func")
    package = "sc_fake_pkg"
    versions = ">=1.0,<2"

    def needed(self, module):
        return None if getattr(module, "ALREADY_FIXED", False) else "fake break"

    def _apply(self, module):
        self.wrap(module.Thing, "method", lambda w, i, a, k: w(*a, **k) * 10)
        self.wrap(module, "func", lambda w, i, a, k: -w(*a, **k))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda p: "1.5.0" if p == "sc_fake_pkg" else None)
    p = FakePatch()
    mod = make_module("sc_fake_target")
    monkeypatch.setitem(sys.modules, "sc_fake_target", mod)
    yield p, mod
    p.revert()


def test_apply_wraps_and_keeps_originals(fake):
    p, mod = fake
    orig_method, orig_func = vars(mod.Thing)["method"], mod.func
    p.on_import(mod)
    assert p.is_applied() and p.state.reason == "fake break"
    assert mod.Thing().method(1) == 20 and mod.func(3) == -6
    assert isinstance(vars(mod.Thing)["method"], wrapt.FunctionWrapper)
    assert vars(mod.Thing)["method"].__wrapped__ is orig_method
    assert mod.func.__wrapped__ is orig_func
    assert registry.is_ours(mod.func) == "fake"


def test_never_double_wraps(fake):
    p, mod = fake
    p.on_import(mod)
    wrapped = mod.func
    p.on_import(mod)
    p.state.applied = False  # even a forced second apply must not stack a second wrapper
    p.on_import(mod)
    assert mod.func is wrapped and mod.func(3) == -6


def test_unpatch_restores_identity_and_repatch_works(fake):
    p, mod = fake
    orig_method, orig_func = vars(mod.Thing)["method"], mod.func
    p.on_import(mod)
    p.revert()
    assert vars(mod.Thing)["method"] is orig_method and mod.func is orig_func
    assert not p.is_applied() and "reverted" in p.state.reason
    p.on_import(mod)
    assert p.is_applied() and mod.func(3) == -6


def test_version_gate(fake, monkeypatch):
    p, mod = fake
    monkeypatch.setattr(versions, "installed", lambda pkg: "2.0.0rc1.dev7+gabc" if pkg == "sc_fake_pkg" else None)
    p.on_import(mod)
    assert not p.is_applied() and p.state.applies is False and "outside" in p.state.reason
    assert mod.func(3) == 6


def test_feature_probe_leaves_fixed_code_alone(fake):
    p, mod = fake
    mod.ALREADY_FIXED = True
    p.on_import(mod)
    assert not p.is_applied() and "does not need it" in p.state.reason


def test_missing_target_is_reported_not_silent(fake, caplog):
    p, mod = fake
    del mod.func
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        p.on_import(mod)
    assert not p.is_applied() and p.state.applies is True
    assert "fake" in p.state.reason and "func" in p.state.reason and "sc_fake_pkg 1.5.0" in p.state.reason
    assert any("func" in r.message for r in caplog.records)
    # and the half-applied part was rolled back
    assert not isinstance(vars(mod.Thing)["method"], wrapt.FunctionWrapper)


def test_broken_probe_is_reported(fake, caplog):
    p, mod = fake

    def boom(module):
        raise AttributeError("Thing.gone")

    p.needed = boom
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        p.on_import(mod)
    assert not p.is_applied() and "probe failed" in p.state.reason
    assert caplog.records


def test_post_import_hook_applies_when_target_imported_later(tmp_path, monkeypatch):
    """A real import through the hooks' finder on sys.meta_path (installed by importing
    speculators_compat): the module executes first, then its patch applies."""
    from speculators_compat import patches

    monkeypatch.setattr(versions, "installed", lambda p: "1.5.0" if p == "sc_fake_pkg" else None)
    (tmp_path / "sc_fake_late.py").write_text(
        "class Thing:\n    def method(self, x):\n        return x + 1\n\ndef func(x):\n    return x * 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    class LatePatch(FakePatch):
        module = "sc_fake_late"

    p = LatePatch()
    monkeypatch.setattr(hooks, "_enabled", True)
    monkeypatch.setattr(hooks, "TRIGGERS", hooks.TRIGGERS | {"sc_fake_late"})
    monkeypatch.setattr(patches, "all_patches", lambda: [p])
    assert hooks._finder in sys.meta_path
    assert not p.is_applied()
    import sc_fake_late  # noqa: F401

    try:
        assert p.is_applied() and sc_fake_late.func(2) == -4
        assert sc_fake_late.__spec__.loader.get_filename("sc_fake_late").endswith("sc_fake_late.py")  # (delegated)
    finally:
        p.revert()
        sys.modules.pop("sc_fake_late", None)


def test_untested_future_vllm_warns_once(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda p: "0.40.0.dev3+gabc" if p == "vllm" else None)
    monkeypatch.setattr(hooks, "_warned_untested", False)

    class V(FakePatch):
        package = "vllm"

    with pytest.warns(RuntimeWarning, match="newer than the tested range"):
        hooks._warn_if_untested(V())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hooks._warn_if_untested(V())  # second time: silent


def test_every_registered_patch_declares_itself():
    """Every field doctor and the inventory print is there, and the test a patch names as its
    proof exists (file and function)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for p in patches.all_patches():
        r = p.report()
        for key in ("name", "module", "targets", "package", "versions", "risk", "test", "description"):
            assert r[key], f"patch {p.name} does not declare {key}"
        refs = re.findall(r"tests/[\w/]+\.py(?:::\w+)?", r["test"])
        assert refs, f"patch {p.name} names no test file: {r['test']!r}"
        for ref in refs:
            path, _, func = ref.partition("::")
            assert (root / path).is_file(), f"patch {p.name} names {path}, which does not exist"
            if func:
                assert re.search(rf"^def {func}\(", (root / path).read_text(), re.M), f"{p.name}: no {ref}"
        assert p.process in ("driver", "worker", "both")
        from packaging.specifiers import SpecifierSet

        SpecifierSet(p.versions)

"""The contract every registered patch keeps, on the real targets of this environment's versions:
patch then import, import then patch, a second patch changes nothing, unpatch restores the very
objects that were there, and a repatch applies again. (What each patch fixes is tested in
test_patches_engine.py and the baseline tests; this is the life cycle.)"""

import importlib
import json
import subprocess
import sys

import pytest

import speculators_compat
from speculators_compat import hooks
from speculators_compat.patches import all_patches
from speculators_compat.registry import is_ours

NAMES = [p.name for p in all_patches()]
_MISSING = object()


def _patch(name):
    return next(p for p in all_patches() if p.name == name)


def _places(patch) -> list[tuple]:
    """(owner, attribute) pairs a patch's declared targets live in: a class or module attribute
    ("module:Class.attr", "module:name (note)"), a module's ``__getattr__`` (what a module-level
    hook replaces), or a ``sys.modules`` entry ("module (module)")."""
    out = []
    for t in patch.targets:
        spec = t.split(" (")[0]
        if ":" not in spec:
            out.append((sys.modules, spec))
            continue
        mod_name, path = spec.split(":")
        owner = importlib.import_module(mod_name)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        out.append((owner, attr))
        if not parents:
            out.append((owner, "__getattr__"))
    return out


def _snapshot(places) -> list:
    return [(owner if isinstance(owner, dict) else vars(owner)).get(attr, _MISSING) for owner, attr in places]


@pytest.mark.parametrize("name", NAMES)
def test_patch_life_cycle(name):
    p = _patch(name)
    try:
        module = importlib.import_module(p.module)
    except Exception as e:
        pytest.skip(f"{p.module} does not import here: {type(e).__name__}: {e}")
    if not p.state.applies:
        pytest.skip(f"{name} does not apply here: {p.state.reason}")
    places = _places(p)
    # patch then import (speculators_compat was imported first): applied
    assert p.is_applied(), p.state.reason
    patched = _snapshot(places)
    # a second patch changes nothing
    assert speculators_compat.patch()
    p.on_import(module)
    assert all(a is b for a, b in zip(_snapshot(places), patched))
    try:
        p.revert()
        original = _snapshot(places)
        changed = [i for i, (a, b) in enumerate(zip(original, patched)) if a is not b]
        assert changed, f"{name}: applying it changed none of its declared targets {p.targets}"
        assert not any(is_ours(original[i]) for i in changed)
        # repatch: applied again, over the same originals
        p.on_import(module)
        assert p.is_applied()
        again = _snapshot(places)
        for i in changed:
            assert is_ours(again[i]) == name or again[i] is not original[i]
            wrapped = getattr(again[i], "__wrapped__", _MISSING)
            if wrapped is not _MISSING and original[i] is not _MISSING:
                assert wrapped is original[i], f"{name}: repatched {places[i][1]} does not wrap the original"
        # and unpatch restores the very objects again
        p.revert()
        assert all(a is b for a, b in zip(_snapshot(places), original))
    finally:
        p.on_import(module)  # (the rest of the test run stays patched)
    assert p.is_applied()


def test_import_then_patch_applies_what_patch_then_import_does():
    """Every target imported first, speculators_compat after: the same patches apply, to each
    target that imports unpatched (under transformers 5, speculators does not: that is what the
    transformers patches are for, and why they must come first)."""
    targets = sorted({p.module for p in all_patches()})
    code = (
        f"import importlib, json\nok = []\nfor m in {targets!r}:\n"
        "    try:\n        importlib.import_module(m)\n        ok.append(m)\n    except Exception:\n        pass\n"
        "import speculators_compat\nfrom speculators_compat.patches import all_patches\n"
        "print(json.dumps({p.name: p.is_applied() for p in all_patches() if p.module in ok}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    late = json.loads(r.stdout.strip().splitlines()[-1])
    assert late, "no patch target imported before speculators_compat"
    for p in all_patches():  # (in this process: patch then import, by the tests above)
        if p.name in late:
            importlib.import_module(p.module)
            assert late[p.name] == p.is_applied(), (p.name, p.state.reason)
    assert hooks.enabled()

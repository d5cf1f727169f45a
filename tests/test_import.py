"""``import speculators_compat`` is cheap and pulls in neither vLLM nor torch nor transformers."""

import json
import subprocess
import sys

CODE = r"""
import json, sys, time
t = time.perf_counter()
import speculators_compat
dt = time.perf_counter() - t
heavy = sorted(m for m in ("vllm", "torch", "transformers", "speculators") if m in sys.modules)
# what the import itself loaded, before status() (which loads the registry) runs
deferred = sorted(m for m in ("wrapt", "packaging", "importlib.metadata", "logging", "speculators_compat.registry")
                  if m in sys.modules)
print(json.dumps({"seconds": dt, "heavy": heavy, "deferred": deferred,
                  "enabled": speculators_compat.status()["enabled"]}))
"""


def _run(env=None):
    import os

    e = dict(os.environ)
    e.update(env or {})
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=e, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_is_cheap_and_light():
    r = _run()
    print(f"import speculators_compat: {r['seconds'] * 1000:.1f} ms")
    assert r["heavy"] == [], f"importing speculators_compat pulled in {r['heavy']}"
    assert r["enabled"] is True
    assert r["seconds"] < 2.0  # generous: a regression to importing torch/vLLM costs 2-10 s here
    # wrapt (which imports asyncio), packaging and the registry load only when a target is imported:
    # `python -X importtime -c "import speculators_compat"` is a few ms (docs/architecture.md)
    assert r["deferred"] == [], f"importing speculators_compat loaded {r['deferred']} up front"


def test_the_hooks_watch_every_patch_target():
    from speculators_compat import hooks
    from speculators_compat.patches import all_patches

    assert hooks.TRIGGERS == {p.module for p in all_patches()}


def test_disable_env_turns_everything_off():
    r = _run({"SPECULATORS_COMPAT_DISABLE": "1"})
    assert r["enabled"] is False

"""Post-import hooks: patches apply when their target is imported (or at once if it already was).

``install()`` is what ``import speculators_compat`` and the vLLM plugin call. It imports neither
vLLM nor torch, and nothing else outside the standard library's core: a finder on ``sys.meta_path``
watches the modules the patches target (``TRIGGERS``), and only when one of them has been imported
(vLLM, speculators or transformers, which are heavy anyway) does the registry load, with wrapt
(which does the wrapping) and packaging (version checks). ``SPECULATORS_COMPAT_DISABLE=1`` turns
everything off.
"""

from __future__ import annotations

import _thread
import sys

from . import envs

DISABLE_ENV = "SPECULATORS_COMPAT_DISABLE"

#: every patch's target module (``Patch.module``); a unit test keeps this equal to the registry's
TRIGGERS = frozenset(
    {
        "torch",
        "transformers",
        "transformers.configuration_utils",
        "vllm.v1.core.kv_cache_utils",
        "vllm.v1.attention.backends.cpu_attn",
        "vllm.platforms.cpu",
        "vllm.v1.core.sched.scheduler",
        "speculators.data_generation.vllm_hidden_states_generator",
        "speculators.data_generation.custom_worker",
    }
)

_lock = _thread.RLock()
_finder = None
_enabled = False
_warned_untested = False


def disabled_by_env() -> bool:
    try:
        return envs.enabled(DISABLE_ENV)
    except ValueError as e:  # a value it does not know: said, and the patches stay on
        import warnings

        warnings.warn(f"speculators_compat: {e}; the patches stay enabled", RuntimeWarning, stacklevel=2)
        return False


class _Loader:
    """The real loader of a watched module, with the patches' callbacks run once it has executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec) if hasattr(self._loader, "create_module") else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        _imported(module.__name__, module)

    def __getattr__(self, name):  # (resource readers, get_source, ... of the real loader)
        return getattr(self._loader, name)


class _Finder:
    """On ``sys.meta_path``: for a watched module, asks the other finders for its spec and wraps its
    loader; every other import is left alone (returns None at once)."""

    def __init__(self):
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TRIGGERS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


def _imported(name: str, module) -> None:
    if not _enabled:
        return
    from .patches import all_patches

    for p in all_patches():
        if p.module == name:
            _warn_if_untested(p)
            p.on_import(module)


def _warn_if_untested(patch) -> None:
    global _warned_untested
    if patch.package != "vllm" or _warned_untested:
        return
    from . import versions

    tested = versions.vllm_is_tested()
    if tested is False:
        import warnings

        _warned_untested = True
        warnings.warn(
            f"speculators_compat: vLLM {versions.installed('vllm')} is newer than the tested range "
            f"{versions.TESTED_VLLM}; only feature-probed patches are applied. Check "
            "`speculators-compat doctor` and verify a sample against HF before a long run.",
            RuntimeWarning,
            stacklevel=3,
        )


def install() -> bool:
    """Enable the patches and watch their target modules (idempotent); each target already imported
    is patched now. False if disabled."""
    global _finder, _enabled
    if disabled_by_env():
        return False
    with _lock:
        _enabled = True
        if _finder is None:
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)
        for name in sorted(TRIGGERS & set(sys.modules)):  # (parents first: sorted names)
            _imported(name, sys.modules[name])
    return True


def uninstall() -> None:
    """Revert every applied patch (originals restored) and stop applying on future imports."""
    global _enabled
    with _lock:
        _enabled = False
        if "speculators_compat.registry" not in sys.modules:
            return  # nothing was ever applied
        from .patches import all_patches

        for p in reversed(all_patches()):
            p.revert()


def enabled() -> bool:
    return _enabled

"""Post-import hooks: patches apply when their target is imported (or at once if it already was).

``install()`` is what ``import speculators_compat`` and the vLLM plugin call; it imports neither
vLLM nor torch. ``SPECULATORS_COMPAT_DISABLE=1`` turns everything off.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

import wrapt

from . import versions

logger = logging.getLogger("speculators_compat")
DISABLE_ENV = "SPECULATORS_COMPAT_DISABLE"

_lock = threading.RLock()
_hooks_registered = False
_enabled = False
_warned_untested = False


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _on_import_factory(patch):
    def _on_import(module):
        if _enabled:
            _warn_if_untested(patch)
            patch.on_import(module)

    return _on_import


def _warn_if_untested(patch) -> None:
    global _warned_untested
    if patch.package != "vllm" or _warned_untested:
        return
    tested = versions.vllm_is_tested()
    if tested is False:
        _warned_untested = True
        warnings.warn(
            f"speculators_compat: vLLM {versions.installed('vllm')} is newer than the tested range "
            f"{versions.TESTED_VLLM}; only feature-probed patches are applied. Check "
            "`speculators-compat doctor` and verify a sample against HF before a long run.",
            RuntimeWarning, stacklevel=3)


def install() -> bool:
    """Enable the patches and register their post-import hooks (idempotent). False if disabled."""
    global _hooks_registered, _enabled
    if disabled_by_env():
        return False
    from .registry import all_patches

    with _lock:
        _enabled = True
        if not _hooks_registered:
            for p in all_patches():
                wrapt.register_post_import_hook(_on_import_factory(p), p.module)
            _hooks_registered = True
        else:  # re-patch after unpatch(): hooks exist, apply to what is already imported
            for p in all_patches():
                mod = sys.modules.get(p.module)
                if mod is not None:
                    _warn_if_untested(p)
                    p.on_import(mod)
    return True


def uninstall() -> None:
    """Revert every applied patch (originals restored) and stop applying on future imports."""
    global _enabled
    from .registry import all_patches

    with _lock:
        _enabled = False
        for p in reversed(all_patches()):
            p.revert()


def enabled() -> bool:
    return _enabled

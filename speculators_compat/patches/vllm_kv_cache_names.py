"""vLLM 0.33 moved three KV-cache helpers out of ``vllm.v1.core.kv_cache_utils``.

speculators 0.3.0's ``speculators.data_generation`` package imports its generator module, which
does ``from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_spec,
get_kv_cache_config_from_groups, unify_hybrid_kv_cache_specs``. vLLM 0.33 moved all three, with
the same signatures, to ``vllm.v1.core.kv_cache_planning``, so ``import speculators.data_generation``
raises ImportError there: in the driver, and in every worker that loads upstream's worker extension
(same package). This patch gives ``kv_cache_utils`` a module ``__getattr__`` (PEP 562) that finds the
moved names in their new home when they are asked for. It is lazy on purpose: ``kv_cache_planning``
imports ``kv_cache_utils``, so importing it from the post-import hook could meet a half-initialised
module. Our speculators generator patch replaces the upstream code that called these helpers, so
the aliases only have to make the import work; they are still the real functions, and a signature
that differs from the one upstream was written against is logged when a name is first resolved.

Applied by feature: only where the names are missing from ``kv_cache_utils`` (vLLM 0.33 and any
later release that keeps them moved). Where a name is in neither module, asking for it raises an
AttributeError naming this patch, the vLLM version and the modules looked in.
"""

from __future__ import annotations

import importlib
import inspect
import logging

from .. import versions
from ..engine.facts import module_exists
from ..registry import SENTINEL, Patch, PatchTargetError, is_ours

logger = logging.getLogger("speculators_compat")

#: each moved name and the parameters upstream's call sites pass (vLLM 0.11-0.32 signatures)
MOVED = {
    "_get_kv_cache_groups_uniform_spec": ("kv_cache_specs",),
    "get_kv_cache_config_from_groups": ("vllm_config", "kv_cache_groups", "available_memory"),
    "unify_hybrid_kv_cache_specs": ("kv_cache_spec",),
}
#: where vLLM moved them (0.33)
NEW_HOMES = ("vllm.v1.core.kv_cache_planning",)


def _missing(module) -> list[str]:
    return [n for n in MOVED if n not in vars(module)]


class KVCacheNamesPatch(Patch):
    name = "vllm_kv_cache_names"
    module = "vllm.v1.core.kv_cache_utils"
    targets = tuple(f"vllm.v1.core.kv_cache_utils:{n} (moved to kv_cache_planning in 0.33)" for n in MOVED)
    package = "vllm"
    versions = ">=0.11"
    process = "both"
    risk = (
        "low: resolves names only where kv_cache_utils lacks them; a helper moved somewhere else "
        "again fails at the import with this patch named in the error"
    )
    description = (
        "0.33 moved _get_kv_cache_groups_uniform_spec, get_kv_cache_config_from_groups and "
        "unify_hybrid_kv_cache_specs to kv_cache_planning: `import speculators.data_generation` "
        "raised ImportError in the driver and in workers; resolve them from their new home"
    )
    test = "tests/engine/test_patches_engine.py::test_kv_cache_names_patch, tests/test_kv_cache_names.py"

    def needed(self, module):
        missing = _missing(module)
        if not missing:
            return None
        return (
            f"vllm.v1.core.kv_cache_utils lacks {', '.join(missing)}, which speculators 0.3.0 "
            f"imports (ImportError at `import speculators.data_generation`)"
        )

    def _apply(self, module):
        missing = _missing(module)
        homes = [h for h in NEW_HOMES if module_exists(h)]
        if not homes:
            raise PatchTargetError(
                f"patch {self.name}: vLLM {versions.installed('vllm')}: kv_cache_utils lacks {missing} "
                f"and none of {list(NEW_HOMES)} exists; speculators 0.3.0 cannot be imported"
            )
        previous = vars(module).get("__getattr__")
        patch_name = self.name
        checked: set[str] = set()

        def __getattr__(attr):
            if attr in missing:
                for home in homes:
                    value = getattr(importlib.import_module(home), attr, None)
                    if value is not None:
                        if attr not in checked:
                            checked.add(attr)
                            _check_signature(patch_name, attr, value, home)
                        return value
                raise AttributeError(
                    f"speculators_compat patch {patch_name}: vLLM {versions.installed('vllm')} has "
                    f"{attr!r} neither in {module.__name__} nor in {homes}"
                )
            if previous is not None:
                return previous(attr)
            raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")

        setattr(__getattr__, SENTINEL, self.name)
        self._previous = previous
        module.__getattr__ = __getattr__
        self._target = module

    def _revert(self, module):
        module = getattr(self, "_target", None) or module  # the module object we patched
        self._target = None
        if module is None:
            return
        current = vars(module).get("__getattr__")
        if is_ours(current) != self.name:
            if current is not None:
                logger.warning(
                    "patch %s: %s.__getattr__ was replaced by someone else; leaving it", self.name, module.__name__
                )
            return
        previous, self._previous = getattr(self, "_previous", None), None
        if previous is None:
            del module.__getattr__
        else:
            module.__getattr__ = previous


def _check_signature(patch_name: str, attr: str, fn, home: str) -> None:
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return
    if params[: len(MOVED[attr])] != MOVED[attr]:
        logger.warning(
            "speculators_compat: patch %s: vLLM %s's %s.%s takes %s, not %s as upstream's "
            "code expects; calling it the old way may fail",
            patch_name,
            versions.installed("vllm"),
            home,
            attr,
            params,
            MOVED[attr],
        )

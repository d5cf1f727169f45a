"""Patch declarations and their life cycle: applies? -> apply -> applied -> revert.

Every patch is a small module under ``speculators_compat.patches`` defining a ``Patch`` subclass.
A patch declares
  * ``module``: the module whose import triggers it (a post-import hook fires when it is imported,
    or at once if it already was);
  * ``targets``: the internals it touches, for the inventory;
  * ``package`` / ``versions``: a ``packaging`` specifier on the package's *base* version;
  * ``needed(module)``: a feature probe returning why it is needed, or None when the installed
    code does not have the break (a nightly that already fixed it is left alone);
  * ``_apply(module)`` / ``_revert(module)``; wrappers are wrapt ``FunctionWrapper``s so the
    original stays on ``__wrapped__`` and revert is identity-checked;
  * ``risk`` and ``test``: what breaks if vLLM changes the target, and the test that proves it.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import wrapt
from packaging.specifiers import SpecifierSet

from . import versions

logger = logging.getLogger("speculators_compat")
_lock = threading.RLock()


#: the one attribute that marks what speculators_compat put in place (a wrapper, a module hook, a
#: shim module), holding the name of the patch that did; ``_self_`` keeps it on a wrapt wrapper itself
SENTINEL = "_self_speculators_compat"


class PatchTargetError(RuntimeError):
    """A patch's target is missing or changed shape: says which patch, which version, what it found."""


@dataclass
class PatchState:
    applies: bool | None = None  # None: target not imported yet
    applied: bool = False
    reason: str = "target module not imported yet"


class Patch:
    name: ClassVar[str]
    module: ClassVar[str]
    targets: ClassVar[tuple[str, ...]]
    package: ClassVar[str]
    versions: ClassVar[str]
    risk: ClassVar[str] = ""
    description: ClassVar[str] = ""
    test: ClassVar[str] = ""
    #: where the fix must run: "driver", "worker" or "both"
    process: ClassVar[str] = "driver"

    def __init__(self) -> None:
        self.state = PatchState()
        self._originals: list[tuple[Any, str, Any, Any]] = []  # (owner, attr, original, wrapper)

    # -- to implement --------------------------------------------------------
    def needed(self, module) -> str | None:  # pragma: no cover - overridden
        """Why the installed target needs this patch, or None if it does not."""
        return "always"

    def _apply(self, module) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _revert(self, module) -> None:
        self._unwrap_all()

    # -- helpers for subclasses ---------------------------------------------
    def wrap(self, owner: Any, attr: str, wrapper) -> None:
        """Wrap ``owner.attr`` with a wrapt wrapper ``(wrapped, instance, args, kwargs)``."""
        original = getattr(owner, attr, None)
        if original is None:
            raise PatchTargetError(
                f"patch {self.name}: {getattr(owner, '__name__', owner)}.{attr} is "
                f"missing in {self.package} {versions.installed(self.package)}"
            )
        if is_ours(original) == self.name:
            return
        own = vars(owner) if isinstance(owner, type) else {}
        raw = own.get(attr, original) if isinstance(owner, type) else original
        fw = wrapt.FunctionWrapper(raw, wrapper)
        setattr(fw, SENTINEL, self.name)
        setattr(owner, attr, fw)
        self._originals.append((owner, attr, raw if attr in own or not isinstance(owner, type) else None, fw))

    def replace_methods(self, cls: type, replacements: dict) -> None:
        """Put ``fn(instance, *args, **kwargs)`` in place of each ``cls.<name>`` of ``replacements``
        (wrapped, so unpatch restores the originals)."""
        for attr, fn in replacements.items():

            def wrapper(wrapped, instance, args, kwargs, fn=fn):
                return fn(instance, *args, **kwargs)

            wrapper.__name__ = fn.__name__
            self.wrap(cls, attr, wrapper)

    def _unwrap_all(self) -> None:
        for owner, attr, raw, fw in reversed(self._originals):
            current = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
            if current is fw:
                if raw is None:  # was inherited: remove our override
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, raw)
            else:
                logger.warning(
                    "patch %s: %s.%s was re-wrapped by someone else; leaving it",
                    self.name,
                    getattr(owner, "__name__", owner),
                    attr,
                )
        self._originals.clear()

    # -- life cycle -----------------------------------------------------------
    def version_applies(self) -> tuple[bool, str]:
        v = versions.installed(self.package)
        if v is None:
            return False, f"{self.package} not installed"
        base = versions.base_version(v)
        if base is None:
            return False, f"cannot parse {self.package} version {v!r}"
        if not SpecifierSet(self.versions).contains(base, prereleases=True):
            return False, f"{self.package} {v} outside {self.versions}"
        return True, f"{self.package} {v} in {self.versions}"

    def on_import(self, module) -> None:
        with _lock:
            if self.state.applied:
                return
            ok, why = self.version_applies()
            if not ok:
                self.state = PatchState(False, False, why)
                return
            try:
                need = self.needed(module)
            except Exception as e:  # a probe that cannot even look means the target changed
                self.state = PatchState(False, False, f"probe failed: {type(e).__name__}: {e}")
                logger.warning(
                    "speculators_compat: patch %s: cannot probe %s (%s %s): %s",
                    self.name,
                    self.module,
                    self.package,
                    versions.installed(self.package),
                    e,
                )
                return
            if need is None:
                self.state = PatchState(False, False, f"{why}, but the installed code does not need it")
                return
            try:
                self._apply(module)
            except PatchTargetError as e:
                self._unwrap_all()
                self.state = PatchState(True, False, str(e))
                logger.warning("speculators_compat: %s", e)
                return
            self.state = PatchState(True, True, need)
            logger.debug("speculators_compat: applied %s (%s)", self.name, need)

    def revert(self) -> None:
        with _lock:
            if not self.state.applied:
                return
            mod = sys.modules.get(self.module)
            self._revert(mod)
            self.state = PatchState(self.state.applies, False, "reverted by unpatch()")

    def is_applied(self) -> bool:
        return self.state.applied

    def report(self) -> dict:
        return {
            "name": self.name,
            "module": self.module,
            "targets": list(self.targets),
            "package": self.package,
            "versions": self.versions,
            "process": self.process,
            "applies": self.state.applies,
            "applied": self.state.applied,
            "reason": self.state.reason,
            "risk": self.risk,
            "test": self.test,
            "description": self.description,
        }


def is_ours(obj: Any) -> str | None:
    """Name of the patch that wrapped ``obj``, if any."""
    return getattr(obj, SENTINEL, None)

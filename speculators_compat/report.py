"""``speculators_compat.status()`` and the text ``speculators-compat doctor`` prints."""

from __future__ import annotations

from . import hooks, versions
from ._version import __version__


def build_status(probe_engine: bool = False) -> dict:
    from .patches import all_patches

    st = {
        "speculators_compat": __version__,
        "enabled": hooks.enabled(),
        "disabled_by_env": hooks.disabled_by_env(),
        "versions": versions.report(),
        "vllm_tested_range": str(versions.TESTED_VLLM),
        "vllm_tested": versions.vllm_is_tested(),
        "patches": [p.report() for p in all_patches()],
        "speculators_path": speculators_path(versions.installed("speculators")),
        "self_check": _self_check(),
    }
    if probe_engine:
        try:
            from .engine import facts

            st["vllm_facts"] = facts.probe().as_dict()
        except ImportError as e:
            st["vllm_facts"] = {"error": f"vLLM not importable: {e}"}
    return st


def speculators_path(installed: str | None) -> str:
    """What applies to the installed speculators release (None: not installed)."""
    if installed is None:
        return "not installed: the drop-in generator and `extract` need none"
    v = versions.base_version(installed)
    if v is None or v < versions.Version("0.3.0"):
        return f"{installed}: not supported (speculators 0.3.0 and later are)"
    from packaging.specifiers import SpecifierSet

    from .patches import all_patches
    from .patches.speculators_generator import GeneratorPatch

    for p in all_patches():
        if isinstance(p, GeneratorPatch) and SpecifierSet(p.versions).contains(v, prereleases=True):
            return (
                f"{installed}: its VllmHiddenStatesGenerator (and its offline script) run our engine "
                f"loop (patch {p.name}); `extract` writes its data_{{i}}.pt"
            )
    if v < versions.Version("0.5.0"):
        return f"{installed}: no patch declares this release (0.3.0 and 0.4.x have one)"
    return (
        f"{installed}: has no generator (it extracts through vLLM's own extract_hidden_states, "
        "far slower than raw prefill: docs/benchmarks.md); `extract --format speculators-hs` writes the "
        "hs_{i}.safetensors + input_ids/loss_mask dataset its trainer reads"
    )


def _self_check() -> dict:
    from . import envs
    from .engine import selfcheck

    try:
        on = envs.enabled("SPECULATORS_COMPAT_SELF_CHECK")
    except ValueError as e:
        on = str(e)
    return {"default_on": on, "proves": selfcheck.PROVES, "cannot": selfcheck.CANNOT}


def format_status(st: dict) -> str:
    lines = [
        f"speculators-compat {st['speculators_compat']}  "
        f"({'enabled' if st['enabled'] else 'DISABLED'}{' by SPECULATORS_COMPAT_DISABLE' if st['disabled_by_env'] else ''})"
    ]
    for k, v in st["versions"].items():
        lines.append(f"  {k:<13} {v or 'not installed'}")
    tested = st["vllm_tested"]
    lines.append(
        f"  vLLM tested range {st['vllm_tested_range']}: "
        + {True: "yes", False: "NO (untested: only feature-probed patches apply)", None: "n/a"}[tested]
    )
    lines.append(f"  speculators release: {st['speculators_path']}")
    lines.append("")
    lines.append(f"  {'patch':<30} {'applies':<8} {'applied':<8} reason")
    for p in st["patches"]:
        a = {None: "?", True: "yes", False: "no"}[p["applies"]]
        lines.append(f"  {p['name']:<30} {a:<8} {'yes' if p['applied'] else 'no':<8} {p['reason']}")
    sc = st["self_check"]
    lines.append("")
    lines.append(
        "  self-check: on in `extract` (--no-self-check: off); in the generators "
        f"{'on' if sc['default_on'] is True else 'off' if sc['default_on'] is False else sc['default_on']}"
        " (self_check=, SPECULATORS_COMPAT_SELF_CHECK)"
    )
    lines.append(f"    proves: {sc['proves']}")
    lines.append(f"    cannot see: {sc['cannot']}")
    if "vllm_facts" in st:
        lines.append("")
        lines.append("  vLLM facts (probed):")
        for k, v in st["vllm_facts"].items():
            lines.append(f"    {k:<44} {v}")
    return "\n".join(lines)

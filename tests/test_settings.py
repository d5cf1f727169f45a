"""Every setting is declared once (speculators_compat/envs.py): the README's table is generated
from it, and the package reads no SPECULATORS_COMPAT_ variable that is not declared."""

import re
from pathlib import Path

from speculators_compat import envs

ROOT = Path(__file__).resolve().parents[1]


def test_readme_settings_table_is_generated_from_envs():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- settings table: generated -->\n(.*?)<!-- end of settings table -->", readme, re.S)
    assert m, "README.md has no generated settings table"
    assert m.group(1) == envs.table_markdown(), "README settings table is stale: python -m speculators_compat.envs"


def test_the_package_reads_only_declared_settings():
    named = set()
    for f in (ROOT / "speculators_compat").rglob("*.py"):
        named |= set(re.findall(r"SPECULATORS_COMPAT_[A-Z_]+", f.read_text()))
    assert named <= set(envs.SETTINGS), sorted(named - set(envs.SETTINGS))


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("SPECULATORS_COMPAT_HANDOFF", "pipe")
    try:
        envs.get("SPECULATORS_COMPAT_HANDOFF")
    except ValueError as e:
        assert "SPECULATORS_COMPAT_HANDOFF must be one of shm, rpc, not 'pipe'" in str(e)
    else:
        raise AssertionError("accepted")

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_inventory_is_current():
    spec = importlib.util.spec_from_file_location("gen_inventory", ROOT / "scripts" / "gen_inventory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (ROOT / "docs" / "inventory.md").read_text() == mod.render(), (
        "docs/inventory.md is stale: run python scripts/gen_inventory.py"
    )

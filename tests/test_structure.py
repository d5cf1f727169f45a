"""The package's shape: dependencies flow one way (cli -> pipeline -> generator -> engine -> host
facts, errors, settings; patches may use the engine, never the reverse), no import cycle between
its modules (function-level imports included), and no module past the size a maintainer holds in
mind. Read from the source with ast: nothing is imported."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "speculators_compat"
MAX_LINES = 520  # (~500: one formatter-wrapped module may run a little over)


def _module_name(f: Path) -> str:
    parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(f): f for f in PKG.rglob("*.py")}
    graph = {}
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                cands = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            for c in cands:
                if c in mods and c != name:
                    deps.add(c)
                    break
        graph[name] = deps
    return graph


def test_the_engine_never_imports_its_consumers():
    g = _graph()
    banned = (
        "speculators_compat.generator",
        "speculators_compat.patches",
        "speculators_compat.pipeline",
        "speculators_compat.cli",
        "speculators_compat.launcher",
    )
    bad = {
        m: sorted(d for d in deps if d.startswith(banned))
        for m, deps in g.items()
        if m.startswith("speculators_compat.engine")
    }
    assert not {m: d for m, d in bad.items() if d}


def test_layers_below_never_import_layers_above():
    g = _graph()
    order = {
        "speculators_compat.generator": ("speculators_compat.pipeline", "speculators_compat.cli"),
        "speculators_compat.pipeline": ("speculators_compat.cli",),
        "speculators_compat.patches": ("speculators_compat.pipeline", "speculators_compat.cli"),
    }
    for low, above in order.items():
        for m, deps in g.items():
            if m.startswith(low):
                assert not [d for d in deps if d.startswith(above)], (m, deps)


def test_no_import_cycle():
    g = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_no_module_is_too_long():
    long = {str(f.relative_to(PKG)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"

"""The package's shape: dependencies flow one way (cli -> serve -> pipeline -> generator and
connector -> files -> engine -> host facts, errors, settings; patches may use the engine, never the
reverse; inside the pipeline,
scale/ -> extract -> writers/ -> output/ -> dataset, ranks), no import cycle between its modules
(function-level imports included), no function past the size a reader holds in mind, and no
module past the size a reader scans (both caps: a cap on modules alone pushed code into long functions). Read from the source with ast: nothing is
imported."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "speculators_compat"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500  # a module a reader can scan; past it, split by role


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
        "speculators_compat.serve",
        "speculators_compat.connector",
        "speculators_compat.files",
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
        "speculators_compat.generator": (
            "speculators_compat.pipeline",
            "speculators_compat.cli",
            "speculators_compat.serve",
        ),
        "speculators_compat.pipeline": ("speculators_compat.cli", "speculators_compat.serve"),
        "speculators_compat.patches": (
            "speculators_compat.pipeline",
            "speculators_compat.cli",
            "speculators_compat.serve",
        ),
        "speculators_compat.serve": ("speculators_compat.cli",),
        # the capture connector runs inside vLLM's processes: the engine and the files, nothing above
        "speculators_compat.connector": (
            "speculators_compat.pipeline",
            "speculators_compat.generator",
            "speculators_compat.patches",
            "speculators_compat.cli",
            "speculators_compat.serve",
        ),
        # one room for output files, below every writer of them
        "speculators_compat.files": (
            "speculators_compat.pipeline",
            "speculators_compat.generator",
            "speculators_compat.connector",
            "speculators_compat.patches",
            "speculators_compat.cli",
            "speculators_compat.serve",
        ),
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


def test_no_function_is_too_long():
    long = {}
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{f.relative_to(PKG)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_module_is_too_long():
    long = {
        str(f.relative_to(PKG)): n
        for f in PKG.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by role): {long}"


def test_the_pipeline_folders_import_one_way():
    """scale/ launches extract; extract drives writers/; writers/ write output/; output/ reads only
    dataset and ranks below it (and the package's own lower layers)."""
    g = _graph()
    pl = "speculators_compat.pipeline."
    above = {
        pl + "output": (pl + "writers", pl + "scale", pl + "extract", pl + "command", pl + "options", pl + "plan"),
        pl + "writers": (pl + "scale", pl + "extract", pl + "command", pl + "options"),
        pl + "extract": (pl + "scale", pl + "command"),
        pl + "dataset": (pl + "output", pl + "writers", pl + "scale", pl + "extract"),
        pl + "ranks": (pl + "output", pl + "writers", pl + "scale", pl + "extract"),
    }
    bad = {}
    for low, banned in above.items():
        for m, deps in g.items():
            if m == low or m.startswith(low + "."):
                hit = sorted(d for d in deps if d.startswith(banned))
                if hit:
                    bad[m] = hit
    assert not bad, bad

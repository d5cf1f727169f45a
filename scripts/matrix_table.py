#!/usr/bin/env python3
"""Print the version x check table from the junit XML files scripts/test.sh wrote (stdlib only)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

GROUPS = [  # (column, file prefix of the test)
    ("baseline (upstream unmodified)", "tests.engine.test_baseline_upstream"),
    ("upstream + import", "tests.engine.test_upstream_patched"),
    ("patches", "tests.engine.test_patches_engine"),
    ("drop-in generator", "tests.engine.test_dropin"),
    ("pipeline", "tests.engine.test_pipeline"),
    ("scaling out", "tests.engine.test_scale_out"),
    ("speculators 0.4 / trainers", "tests.engine.test_speculators_releases"),
    ("unit and other", "tests."),
]


def load(results: Path):
    cells = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0.0]))  # version -> group -> [p, f, s, t]
    for f in sorted(results.glob("junit-*.xml")):
        version = f.stem[len("junit-") :]
        for case in ET.parse(f).getroot().iter("testcase"):
            cls = case.get("classname", "")
            group = next(g for g, prefix in GROUPS if cls.startswith(prefix) or prefix == "tests.")
            cell = cells[version][group]
            if case.find("failure") is not None or case.find("error") is not None:
                cell[1] += 1
            elif case.find("skipped") is not None:
                cell[2] += 1
            else:
                cell[0] += 1
            cell[3] += float(case.get("time", 0))
    return cells


def main() -> int:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    cells = load(results)
    totals = [0, 0, 0]
    for groups in cells.values():
        for p, f, s, _ in groups.values():
            totals[0] += p
            totals[1] += f
            totals[2] += s
    if "--summary-line" in sys.argv:
        print(f"{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
        return 0
    times = {}
    tf = results / "times.txt"
    if tf.exists():
        for line in tf.read_text().split("\n"):
            if line.strip():
                k, v = line.split()
                times[k] = v
    cols = [g for g, _ in GROUPS]
    print("| vLLM | " + " | ".join(cols) + " | cell time |")
    print("|---" * (len(cols) + 2) + "|")
    for version in sorted(cells, key=lambda v: (v != "light", [int(x) if x.isdigit() else x for x in v.split(".")])):
        row = []
        for g in cols:
            p, f, s, t = cells[version].get(g, [0, 0, 0, 0.0])
            if p + f + s == 0:
                row.append("–")
            else:
                row.append(("FAIL " if f else "ok ") + f"{p}/{p + f}" + (f" ({s} skip)" if s else "") + f" {t:.0f}s")
        print(f"| {version} | " + " | ".join(row) + f" | {times.get(version, '?')}s |")
    return 1 if totals[1] else 0


if __name__ == "__main__":
    sys.exit(main())

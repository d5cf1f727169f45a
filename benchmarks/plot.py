#!/usr/bin/env python3
"""Plot tokens/s per contender from ``throughput.py --json`` files: one panel a file.

    python benchmarks/plot.py docs/benchmarks.png \\
        "H200, vLLM 0.20, ~1.1B bf16, 8 x 32 x 1024=docs/results/h200-vllm0.20-llama1b-8x32x1024-contenders.json" \\
        "2-core CPU, vLLM 0.32, tiny Llama f32, 4 x 64 x 128=docs/results/cpu2-...-contenders.json"

Each bar is the median of the timed runs; the whisker spans the fastest and slowest run. Contenders
a file lacks are left out of its panel. Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import json
import sys

ORDER = [  # (row-name prefix in the JSON, label on the plot)
    ("raw", "raw vLLM\nLLM.generate"),
    ("generate", "ours\ngenerate()"),
    ("pipeline", "ours: extract\n(files written)"),
    ("native", "vLLM native\nextract_hidden_states"),
    ("hf", "HF transformers"),
]
COLOURS = {"raw": "#9e9e9e", "generate": "#1f77b4", "pipeline": "#6baed6", "native": "#d62728", "hf": "#ff7f0e"}


def bars(rows: dict) -> list[tuple[str, str, dict]]:
    """(key, label, row) in plotting order; several pipeline rows (e.g. per output directory) each get a bar."""
    out = []
    for prefix, label in ORDER:
        for name, row in rows.items():
            if name == prefix or name.startswith(prefix + "["):
                tag = name[len(prefix) :].strip("[]")
                if prefix == "generate":
                    tag = ""  # generate[cuda] / generate[cpu]: the device, said in the title
                out.append((prefix, label + (f"\n{tag}" if tag else ""), row))
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [a.split("=", 1) for a in argv[1:]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), squeeze=False)
    for ax, (title, path) in zip(axes[:, 0], panels, strict=True):
        with open(path) as f:
            rows = json.load(f)["rows"]
        items = bars(rows)
        y = list(range(len(items)))[::-1]
        med = [r["tok_s_median"] for _, _, r in items]
        lo = [r["tok_s_median"] - r["tok_s_min"] for _, _, r in items]
        hi = [r["tok_s_max"] - r["tok_s_median"] for _, _, r in items]
        ax.barh(y, med, xerr=[lo, hi], color=[COLOURS[k] for k, _, _ in items], capsize=3)
        ax.set_yticks(y, [lab for _, lab, _ in items], fontsize=8)
        for yi, m, (_, _, r) in zip(y, med, items, strict=True):
            ax.text(r["tok_s_max"], yi, f"  {m:,.0f}", va="center", fontsize=8)
        ax.set_xlim(0, max(r["tok_s_max"] for _, _, r in items) * 1.25)
        ax.set_xlabel("tokens/s (median of timed runs; whiskers: min-max)")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=110)
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

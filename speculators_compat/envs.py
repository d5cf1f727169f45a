"""Every environment variable speculators-compat reads, declared once: name, choices, default and
what it does. The README's settings table is generated from here (``python -m
speculators_compat.envs``) and a test checks that it matches. Stdlib only: ``hooks`` reads
``SPECULATORS_COMPAT_DISABLE`` when ``speculators_compat`` is imported.
"""

from __future__ import annotations

import os


class Setting:
    """One variable: its name, default, the values it takes (None: any, e.g. a path) and what it does."""

    __slots__ = ("name", "default", "choices", "doc")

    def __init__(self, name: str, default: str, choices: tuple[str, ...] | None, doc: str):
        self.name, self.default, self.choices, self.doc = name, default, choices, doc

    def get(self) -> str:
        """The value in force: the environment's (stripped; empty means unset) or the default. A
        value outside ``choices`` is a ValueError naming the variable and what it takes."""
        raw = os.environ.get(self.name, "").strip() or self.default
        if self.choices is not None and raw.lower() not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, not {raw!r}")
        return raw.lower() if self.choices is not None else raw


_BOOL = ("0", "1", "false", "true", "no", "yes", "off", "on")

SETTINGS = {
    s.name: s
    for s in (
        Setting(
            "SPECULATORS_COMPAT_DISABLE",
            "0",
            _BOOL,
            "1: `import speculators_compat` applies no patch (in the driver and in vLLM's workers)",
        ),
        Setting(
            "SPECULATORS_COMPAT_HANDOFF",
            "shm",
            ("shm", "rpc"),
            "how captured states travel from the workers to the driver: a /dev/shm arena, or pickled "
            "through vLLM's RPC (for a host or container without a writable /dev/shm; slower)",
        ),
        Setting(
            "SPECULATORS_COMPAT_ZERO_COPY",
            "1",
            ("1", "0"),
            "the default of the generators' `zero_copy`: 1 returns tensors over the /dev/shm arena (each "
            "keeps its slab there until dropped: `.clone()` what you keep), 0 copies every row out",
        ),
        Setting(
            "SPECULATORS_COMPAT_SELF_CHECK",
            "0",
            ("1", "0"),
            "the default of the generators' `self_check` (the drop-in's and upstream's patched class; `extract` "
            "checks unless `--no-self-check`): 1 checks, for every request, that the token vLLM sampled is the "
            "one its captured final-layer state implies (a `CaptureError` if not)",
        ),
        Setting(
            "SPECULATORS_COMPAT_PT_WRITER",
            "direct",
            ("direct", "torch"),
            "how `data_{i}.pt` files are made: `direct` builds torch.save's bytes without its per-call cost "
            "(checked against torch.save once per process, which it falls back to if they differ); "
            "`torch` always calls torch.save",
        ),
        Setting(
            "SPECULATORS_COMPAT_CACHE",
            os.path.join("~", ".cache", "speculators-compat"),
            None,
            "where the built-in tiny models, the weight files' CRC-32s already read (`weight-crc32.json`) "
            "and the development scripts' engine environments live",
        ),
        Setting(
            "SPECULATORS_COMPAT_SERVE_FILES",
            "",
            None,
            "the file routes and request guards of `serve` (`speculators_compat.serve.files.HiddenStatesFiles`, a "
            "`vllm serve --middleware`): JSON `{folder, tokens, max_body, reserve}`; `serve` sets it, set it "
            "yourself to mount them on a `vllm serve` of your own",
        ),
    )
}


def get(name: str) -> str:
    return SETTINGS[name].get()


def enabled(name: str) -> bool:
    """A boolean setting (one of _BOOL) as a bool."""
    return get(name) in ("1", "true", "yes", "on")


def table_markdown() -> str:
    """The README's settings table."""
    rows = ["| variable | default | values | what it does |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        values = (
            " \\| ".join(f"`{c}`" for c in s.choices)
            if s.choices and s.choices != _BOOL
            else ("`1` / `0`" if s.choices else "JSON" if s.name.endswith("_FILES") else "a path")
        )
        rows.append(f"| `{s.name}` | `{s.default}` | {values} | {s.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table_markdown(), end="")

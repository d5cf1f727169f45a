"""Where each output format keeps its files: the one rule extract, finalize, verify and the
launchers' merge ask.

    pt, safetensors:   OUT/ holds the states, the records (run.json, checksums.jsonl, runs.jsonl,
                       rank_{K}/) and manifest.json
    speculators-hs:    OUT/hidden_states/ holds the states and the records; OUT/ holds the
                       trainer's input_ids/loss_mask dataset (its ``--data-path`` layout)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...files.registry import format_names, get_format, states_subdirs

RECORDS = ("manifest.json", "checksums.jsonl", "run.json")


@dataclass(frozen=True)
class Layout:
    output: Path  # what the user named as --output
    fmt: str

    @classmethod
    def of(cls, output, fmt: str) -> Layout:
        return cls(Path(output), fmt)

    @classmethod
    def of_states(cls, states, fmt: str) -> Layout:
        """The layout whose states (and records) folder is ``states``."""
        states = Path(states)
        return cls(states.parent if get_format(fmt).states_subdir else states, fmt)

    @classmethod
    def find(cls, path) -> Layout:
        """The layout of an existing output, given the folder the user named or its states folder
        (``verify``): read from its run.json."""
        path = Path(path)
        for states in (path, *(path / sub for sub in states_subdirs())):
            try:
                fmt = json.loads((states / "run.json").read_text()).get("format", "pt")
            except (OSError, ValueError):
                continue
            return cls.of_states(states, fmt)
        hs = [path / sub for sub in states_subdirs() if (path / sub).is_dir()]
        if not any((path / n).exists() for n in RECORDS) and hs:
            fmt = next(n for n in format_names() if get_format(n).states_subdir == hs[0].name)
            return cls.of_states(hs[0], fmt)
        return cls(path, "pt")

    @property
    def states(self) -> Path:
        """The data files and the run's records (run.json, checksums.jsonl, rank_{K}/)."""
        sub = get_format(self.fmt).states_subdir
        return self.output / sub if sub else self.output

    @property
    def manifest(self) -> Path:
        return self.states / "manifest.json"

    @property
    def trainer_dataset(self) -> Path | None:
        """Where the trainer's input_ids/loss_mask dataset goes (None: the format has none)."""
        return self.output if get_format(self.fmt).states_subdir else None

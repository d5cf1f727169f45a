"""The output formats: one :class:`Format` record each, registered once. Everything that names,
writes, reads or places a data file asks its format here: ``file_name``/``data_file_index`` (the
names, resume), ``formats.write_sample`` (the bytes), ``verify`` (``read``), ``Layout`` (where the
files go), ``layers.resolve`` (the layer-id convention), the ``--format`` choices of ``extract``
and ``plan``.

A new format is one module that calls ``register(Format(...))`` before the command line is built
(tests/engine/toy_format.py is one); the built-in three are registered by formats.py, which the
package ``files`` imports first. This module imports nothing of the package.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Format:
    """What a format is to the rest of the package."""

    name: str  # the --format value
    stem: str  # its data files are {stem}_{index}.{suffix}
    suffix: str
    #: a sample ({"input_ids", "hidden_states": [per layer], "loss_mask"[, scales]}) -> the file's bytes
    serialise: Callable[[dict], Any]
    #: a file -> {"input_ids", "hidden_states": [per layer][, scales]} (verify's look at FP8 states)
    read: Callable[[Path], dict]
    #: "upstream" (id L: decoder layer L's output) or "eagle3" (id k: the output of k layers): the
    #: convention its layer ids are given in when none is named, and its default ids' rule
    layer_ids: str = "upstream"
    #: its files go to OUT/<states_subdir>, and the trainer's input_ids/loss_mask dataset to OUT
    states_subdir: str | None = None
    shardable: bool = False  # --shard-size N > 1 writes shard_{k}.safetensors of N samples
    sample_lengths: bool = False  # writes sample_lengths.json (speculators 0.4's trainer batches by it)
    #: its own writer, where it has a faster path than ``serialise`` (pt: from the states' memory);
    #: ``(path, sample, checksum, durable, clock, times) -> (digest, bytes)``
    write: Callable | None = None


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add ``fmt`` (a name or a file name already taken by another format is refused)."""
    for other in FORMATS.values():
        if other.name != fmt.name and (other.stem, other.suffix) == (fmt.stem, fmt.suffix):
            raise ValueError(
                f"format {fmt.name}: its files would be named as {other.name}'s ({fmt.stem}_N.{fmt.suffix})"
            )
    if fmt.layer_ids not in ("upstream", "eagle3"):
        raise ValueError(f"format {fmt.name}: layer_ids must be upstream or eagle3, not {fmt.layer_ids!r}")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    """The format named ``name``; ValueError naming the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}: one of {', '.join(FORMATS)}") from None


def format_names() -> list[str]:
    return list(FORMATS)


def file_name(index: int, fmt: str) -> str:
    f = get_format(fmt)
    return f"{f.stem}_{index}.{f.suffix}"


def data_file_index(name: str, fmt: str | None = None) -> int | None:
    """The sample index of data file ``name`` (of format ``fmt``, when given), else None."""
    m = _DATA_FILE_RE.match(name)
    if not m:
        return None
    for f in [get_format(fmt)] if fmt is not None else FORMATS.values():
        if (m.group(1), m.group(3)) == (f.stem, f.suffix):
            return int(m.group(2))
    return None


_DATA_FILE_RE = re.compile(r"^([A-Za-z0-9-]+)_(\d+)\.([A-Za-z0-9]+)$")


def states_subdirs() -> list[str]:
    """The subfolders some format keeps its files in (Layout.find looks there)."""
    return sorted({f.states_subdir for f in FORMATS.values() if f.states_subdir})

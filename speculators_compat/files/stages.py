"""Where a file's time goes: seconds per stage of turning a sample into a durable file.

    encode    building the file's bytes (a pt archive's records and pickle, a safetensors buffer)
    checksum  the records' CRC-32s and the file's own checksum
    write     copying the bytes into the file (the kernel's copy into the page cache)
    sync      the file's write-back (fdatasync: the disk's pace; nothing on a tmpfs)
    rename    the rename into place
    record    the line in checksums.jsonl

A writer keeps one ``StageTimes`` per thread (or process) and adds them up at the end: the figures
are seconds of writer threads summed, not wall-clock time, so with 8 writers they may add up to
8x the run's time. ``docs/benchmarks.md`` has what each stage costs per GB.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

STAGES = ("encode", "checksum", "write", "sync", "rename", "record")


@dataclass
class StageTimes:
    """Seconds spent per stage, and the files and bytes they made (a wire record: the writer
    processes send theirs with each result)."""

    encode: float = 0.0
    checksum: float = 0.0
    write: float = 0.0
    sync: float = 0.0
    rename: float = 0.0
    record: float = 0.0
    files: int = 0
    bytes: int = 0

    def add(self, other: StageTimes) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def take(self) -> StageTimes:
        """What was counted so far, with this record reset (what a writer process reports)."""
        out = StageTimes(**asdict(self))
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return out

    def report(self, **more: float) -> dict:
        """{stage: {"s": seconds, "s_per_gb": seconds per GB written}} and the totals (the run
        record); ``more``: other named seconds to put beside them the same way (the engine's)."""
        gb = self.bytes / 1e9
        seconds = {**{name: getattr(self, name) for name in STAGES}, **more}
        out = {name: {"s": round(s, 4), "s_per_gb": round(s / gb, 4) if gb else None} for name, s in seconds.items()}
        return {**out, "files": self.files, "bytes": self.bytes}


class Clock:
    """Times consecutive stages of one file into a ``StageTimes`` (None: times nothing)."""

    __slots__ = ("times", "t")

    def __init__(self, times: StageTimes | None):
        self.times, self.t = times, time.perf_counter()

    def lap(self, stage: str, minus: float = 0.0) -> None:
        """The time since the last lap goes to ``stage`` (less ``minus`` s, counted elsewhere)."""
        now = time.perf_counter()
        if self.times is not None:
            setattr(self.times, stage, getattr(self.times, stage) + now - self.t - minus)
        self.t = now

    def count(self, stage: str, seconds: float) -> None:
        if self.times is not None:
            setattr(self.times, stage, getattr(self.times, stage) + seconds)

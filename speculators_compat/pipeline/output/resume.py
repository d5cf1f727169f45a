"""The files already written (a part of OutputDir): which a resume may trust, from the records
in ``checksums.jsonl``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ...files.checksums import CHECKSUMS, file_digest
from ...files.formats import SHARD_FILE_RE
from ...files.registry import data_file_index
from .outlock import RANK_DIR_RE

logger = logging.getLogger("speculators_compat.pipeline")


class Resume:
    """Part of OutputDir (outdir.py), which holds root, fmt, part, records and checksum."""

    #: files written within this many seconds of an earlier run's last file, by a writer that did
    #: not sync each file (records without ``"durable": true``), are checksummed on resume: what a
    #: crash or a power cut can hurt (the kernel writes dirty pages back within ~30 s)
    RECENT_S = 60.0

    def _drop_torn_record(self) -> None:
        """A run killed while it appended to checksums.jsonl leaves a torn last line; the next
        record would be appended to it and be lost with it. Cut it off (its file, now unrecorded,
        is computed again)."""
        f = self.records / "checksums.jsonl"
        try:
            data = f.read_bytes()
        except FileNotFoundError:
            return
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            logger.warning("%s: dropping a torn last record (%d bytes) left by an interrupted run", f, len(data) - keep)
            with open(f, "r+b") as fh:
                fh.truncate(keep)

    def check_existing(self, verify_all: bool = False, recent: bool = True) -> list[str]:
        """Remove the finished files a resume must not trust, so that they are computed again, and
        return their names (each one logged with the reason): a file with no checksums.jsonl record
        (a crash between its rename and its record), one whose size differs from its record, one
        changed since it was written (its modification time differs) whose checksum no longer
        matches, and one not recorded as durable written in the last RECENT_S seconds of the run
        before (with ``recent``: that run did not finish), or with ``verify_all`` any, whose
        checksum does not match. A durable record names a file that reached the disk before it
        was renamed and recorded (writers/threads.py): a crash cannot have hurt it."""
        files = [
            p
            for p in self.root.iterdir()
            if (SHARD_FILE_RE.match(p.name) if self.shard_size > 1 else data_file_index(p.name, self.fmt) is not None)
            and self._owns_file(p.name)  # (a rank judges its own files only, by its own records)
        ]
        if not files:
            return []
        by_name = {r["file"]: r for r in self.checksum_records().values()}
        last = max((r.get("mtime_ns", 0) for r in by_name.values()), default=0)
        bad: list[tuple[Path, str]] = []
        for p in files:
            rec = by_name.get(p.name)
            st = p.stat()
            if rec is None:
                bad.append((p, "no record in checksums.jsonl (written as the run before was stopped?)"))
                continue
            if st.st_size != rec.get("bytes"):
                bad.append((p, f"{st.st_size:,} bytes where {rec.get('bytes'):,} were written"))
                continue
            changed = "mtime_ns" in rec and st.st_mtime_ns != rec["mtime_ns"]
            tail = (
                recent
                and not rec.get("durable")
                and "mtime_ns" in rec
                and rec["mtime_ns"] >= last - int(self.RECENT_S * 1e9)
            )
            algo = next((k for k in CHECKSUMS if rec.get(k)), None)
            if algo and (verify_all or changed or tail) and file_digest(p, algo) != rec[algo]:
                bad.append(
                    (
                        p,
                        f"its {algo} differs from the one recorded when it was written"
                        + (" (the file was modified since)" if changed else ""),
                    )
                )
        for p, why in bad:
            logger.warning("%s: %s; computing it again", p.name, why)
            p.unlink()
        return [p.name for p, _ in bad]

    def checksum_records(self, all_ranks: bool = False) -> dict[int, dict]:
        """index -> the checksums.jsonl record of each finished file (a torn line is skipped): this
        rank's, or with ``all_ranks`` every rank's (and a one-engine run's)."""
        dirs = [self.records]
        if all_ranks:
            dirs = [self.root] + sorted(
                (p for p in self.root.iterdir() if RANK_DIR_RE.match(p.name) and p.is_dir()),
                key=lambda p: int(p.name[5:]),
            )
        out: dict[int, dict] = {}
        for d in dirs:
            f = d / "checksums.jsonl"
            if f.exists():
                for line in f.read_text().splitlines():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a torn last line from a crash (finalize rehashes that file)
                    out[rec["index"]] = rec
        return out

"""The output directory: what it holds, who writes it, and what a resume may trust.

    OUT/data_{i}.pt ...       the samples (files.py)
    OUT/run.json              what this output is: model, layer ids, input, settings, and the
                              fingerprints of the model's files and of the input; a rerun with other
                              settings or changed files is refused instead of mixing data
    OUT/checksums.jsonl       one line per finished file: index, name, checksum, bytes, tokens, write time
    OUT/manifest.json         written when a run finishes: counts and every file's checksum, by index
    OUT/runs.jsonl            each run's summary (timings)
    OUT/.lock                 held (flock) by the run writing the directory

A dataset extracted in N parts (``--world-size N``, ranks.py) is one directory too: the data files
and run.json as above (every rank checks run.json against its own settings under ``.run.lock``,
and the first one writes it), while each rank's records are its own:

    OUT/rank_{K}/checksums.jsonl   the files rank K wrote (as above)
    OUT/rank_{K}/runs.jsonl        rank K's runs
    OUT/rank_{K}/done.json         rank K finished its part (what the manifest needs from it)
    OUT/rank_{K}/.lock             held (flock) by the process computing rank K

Every rank holds ``OUT/.lock`` shared (so a one-engine run into the directory is refused) and its
own ``rank_{K}/.lock`` exclusive (so two processes with the same rank are refused). A rank only
ever removes or recomputes the files of its own samples. The rank that finishes last (all
``done.json`` present) writes manifest.json for the whole dataset; ``verify --finalize`` does it
too, for a dataset whose files are all there.

A rerun keeps the checksum algorithm it finds unless told otherwise (the manifest then rehashes the
earlier files, so it never mixes algorithms).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ...errors import OutputError
from ...files.checksums import CHECKSUMS, DEFAULT_CHECKSUM, check_checksum
from ...files.formats import SHARD_FILE_RE, atomic_write, done_from_shards
from ...files.registry import data_file_index
from ..ranks import Part
from .layout import Layout
from .manifest import Manifest
from .outlock import RANK_DIR_RE, OutputLock
from .resume import Resume
from .run_record import RunRecord

logger = logging.getLogger("speculators_compat.pipeline")


class OutputDir(OutputLock, RunRecord, Resume, Manifest):
    """One output directory (module docstring), its jobs in parts: the locks (outlock.py), what the
    output is (run_record.py), which files a resume trusts (resume.py), the end of a run
    (manifest.py); here, preparing it for a run."""

    def __init__(
        self,
        root: str | Path,
        fmt: str = "pt",
        checksum: str | None = None,
        shard_size: int = 1,
        part: Part | None = None,
        unit: int = 1,
    ):
        """``checksum``: see CHECKSUMS; None: the one an earlier run used here, else DEFAULT_CHECKSUM.
        ``shard_size`` > 1: safetensors shards of that many samples (pipeline/shards.py).
        ``part``: the rank this process computes (ranks.py; default: all of it); ``unit``: the
        samples that go to one rank together (``ranks.partition_unit``)."""
        self.root = Path(root)
        self.fmt = fmt
        self.checksum = check_checksum(checksum)
        self.shard_size = shard_size
        self.part = part or Part()
        self.unit = unit
        self.records = self.part.records_dir(self.root)  # this rank's checksums.jsonl / runs.jsonl
        self.sync_s = 0.0  # finalize's write-back of the filesystem, seconds
        self.swept = 0  # temporaries of an interrupted run that prepare() removed
        self._lock_fd: int | None = None
        self._rank_fd: int | None = None
        self._made_root = False  # (lock() made the directory: a refused run removes it again)

    @property
    def manifest_path(self) -> Path:
        return Layout.of_states(self.root, self.fmt).manifest

    def owns(self, index: int) -> bool:
        return self.part.owns(index, self.unit)

    # -- what this output is ------------------------------------------------------------------------

    def recorded(self) -> dict:
        """run.json as the last run left it ({} if there is none or it is unreadable)."""
        try:
            return json.loads((self.root / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    def prepare(
        self,
        run_info: dict,
        total: int | None = None,
        fingerprints: dict | None = None,
        latest: dict | None = None,
        verify_existing: bool = False,
    ) -> set[int]:
        """Create/validate the directory; drop partial and damaged files; return indices already
        complete (``total``: the samples this run reads, if known; it decides whether a short last
        shard is done). ``fingerprints``: {"model": ..., "input": ...} of what the states depend on;
        a resume whose fingerprints differ from the recorded ones is refused, naming what changed
        (paths may change when the files are the same). ``latest``: run.json keys of LATEST.
        ``verify_existing``: checksum every finished file, not only those a crash may have hurt."""
        if self._lock_fd is None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.records.mkdir(exist_ok=True)
            except OSError as e:
                raise OutputError(f"cannot create output directory {self.root}: {e.strerror}") from e
        if not os.access(self.root, os.W_OK):
            raise OutputError(f"output directory {self.root} is not writable")
        run_file = self.root / "run.json"
        with self._run_json_lock():
            if run_file.exists() and not self._holds_samples():
                # a run that stopped before it wrote a sample (a failed start): nothing to protect
                logger.info("%s: run.json of a run that wrote no sample; replaced by this run's", self.root)
                run_file.unlink()
            if run_file.exists():
                try:
                    old = json.loads(run_file.read_text())
                except ValueError as e:
                    raise OutputError(f"{run_file}: unreadable ({e}); is {self.root} an extract output?") from None
                record = self._compare(old, run_info, fingerprints)
            else:
                foreign = sorted(
                    p.name
                    for p in self.root.iterdir()
                    if not p.name.startswith(".") and not (RANK_DIR_RE.match(p.name) and p.is_dir())
                )
                if foreign:
                    raise OutputError(
                        f"{self.root} is not empty ({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}) "
                        "and holds no run.json, so it is no extract output: use a new or empty --output"
                    )
                record = dict(run_info, **({"fingerprints": fingerprints} if fingerprints else {}))
            record.update(latest or {})
            atomic_write(run_file, json.dumps(record, indent=2, sort_keys=True).encode())
        if self.checksum is None:
            earlier = next(iter(self.checksum_records(all_ranks=True).values()), None)  # an earlier run's choice
            self.checksum = next((k for k in CHECKSUMS if k in earlier), "none") if earlier else DEFAULT_CHECKSUM
        self.swept = 0
        for pattern in (".data_*.partial", ".shard_*.partial"):
            for p in self.root.glob(pattern):
                if not self._owns_file(p.name[1 : -len(".partial")]):
                    continue  # (another rank's file in flight)
                p.unlink()  # (ours: the output's lock, held, proves no other run writes here)
                self.swept += 1
        if self.swept:
            logger.warning("removed %d temporary file(s) an interrupted run left in %s", self.swept, self.root)
        self._drop_torn_record()
        manifest = self.root / "manifest.json"
        marker = self.records / "done.json" if self.part.sharded else manifest
        records = self.checksum_records()
        last = max((r.get("mtime_ns", 0) for r in records.values()), default=0)
        # a run that finished made its files durable (finalize) and then wrote the manifest (a
        # rank: its done.json): only a run that did not finish leaves recent files a crash may hurt
        finished = marker.exists() and marker.stat().st_mtime_ns >= last
        self.check_existing(verify_existing, recent=not finished)
        manifest.unlink(missing_ok=True)  # (this run writes it when it finishes: till then the dataset is incomplete)
        if self.part.sharded:
            marker.unlink(missing_ok=True)  # (this rank's part is incomplete until it finishes again)
        if self.shard_size > 1:
            return {i for i in done_from_shards(self.root, self.shard_size, total) if self.owns(i)}
        done = set()
        for p in self.root.iterdir():
            i = data_file_index(p.name, self.fmt)
            if i is not None and self.owns(i):
                done.add(i)
        return done

    def _owns_file(self, name: str) -> bool:
        """Whether the data file or shard ``name`` holds this rank's samples."""
        i = data_file_index(name)
        if i is not None:
            return self.owns(i)
        m = SHARD_FILE_RE.match(name)
        return bool(m) and self.owns(int(m.group(1)) * self.shard_size)

    # -- the files already written -------------------------------------------------------------------

    # -- a sharded run's parts ------------------------------------------------------------------------

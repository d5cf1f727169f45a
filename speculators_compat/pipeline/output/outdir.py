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
import time
from pathlib import Path

from ...errors import OutputError
from ..ranks import Part, merged_extra
from .checksums import CHECKSUMS, DEFAULT_CHECKSUM, check_checksum, file_digest
from .files import SHARD_FILE_RE, atomic_write, data_file_index, done_from_shards, file_name, shard_name
from .layout import Layout
from .outlock import RANK_DIR_RE, OutputLock

logger = logging.getLogger("speculators_compat.pipeline")


class OutputDir(OutputLock):
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
        self._lock_fd: int | None = None
        self._rank_fd: int | None = None
        self._made_root = False  # (lock() made the directory: a refused run removes it again)

    @property
    def manifest_path(self) -> Path:
        return Layout.of_states(self.root, self.fmt).manifest

    def owns(self, index: int) -> bool:
        return self.part.owns(index, self.unit)

    #: run settings a resume may change (run.json keeps the first run's), and what changing them means
    RESUMABLE_CHANGES = {
        "batch_size": "the samples computed now share steps with other neighbours, so their states may "
        "differ in the last bits from an uninterrupted run's (vLLM is not batch-invariant); "
        "they are as right (a lower --batch-size is the way out of a memory error)"
    }
    #: run.json keys that describe the latest run rather than the dataset: rewritten, never compared
    LATEST = ("samples", "skipped_overlength", "input_scan")
    #: files written within this many seconds of an earlier run's last file are checksummed on
    #: resume: what a crash or a power cut can hurt (the kernel writes dirty pages back within ~30 s)
    RECENT_S = 60.0

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
        for pattern in (".data_*.partial", ".shard_*.partial"):
            for p in self.root.glob(pattern):
                if not self._owns_file(p.name[1 : -len(".partial")]):
                    continue  # (another rank's file in flight)
                logger.info("removing partial file %s from an interrupted run", p.name)
                p.unlink()
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

    def check_total(self, total: int) -> None:
        """Refuse a run that reads fewer samples than this output holds files for (a smaller
        ``--max-samples`` over a larger dataset): its manifest would leave those files out."""
        if self.shard_size > 1:
            return
        beyond = sorted(
            i for p in self.root.iterdir() if (i := data_file_index(p.name, self.fmt)) is not None and i >= total
        )
        if beyond:
            raise OutputError(
                f"{self.root} holds files of {len(beyond)} sample(s) at index {total} and above (up to "
                f"{beyond[-1]}), but this run reads {total}: it would leave them out of the dataset. "
                "Leave out --max-samples (or give the earlier one), or use a new --output"
            )

    def _holds_samples(self) -> bool:
        """Whether any run wrote a sample here (a data file or shard, partial or whole, a record, or
        another rank's directory): only then is there a run to protect from other settings."""
        for p in self.root.iterdir():
            name = p.name[1 : -len(".partial")] if p.name.endswith(".partial") else p.name
            if data_file_index(name) is not None or SHARD_FILE_RE.match(name) or RANK_DIR_RE.match(p.name):
                return True
        return bool(self.checksum_records(all_ranks=True))

    def _owns_file(self, name: str) -> bool:
        """Whether the data file or shard ``name`` holds this rank's samples."""
        i = data_file_index(name)
        if i is not None:
            return self.owns(i)
        m = SHARD_FILE_RE.match(name)
        return bool(m) and self.owns(int(m.group(1)) * self.shard_size)

    def confirm(self, engine_info: dict, record: bool = True) -> None:
        """What only the engine settles (the dtype: "auto" resolved by the engine, an explicit one
        checked before it starts) must match what run.json recorded; with ``record``, a first run
        records it."""
        with self._run_json_lock():  # (the ranks of a sharded run record into one run.json)
            self._confirm(engine_info, record)

    def _confirm(self, engine_info: dict, record: bool) -> None:
        run_file = self.root / "run.json"
        old = json.loads(run_file.read_text())
        diff = {k: (old[k], v) for k, v in engine_info.items() if k in old and old[k] != v}
        if diff:
            detail = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise OutputError(
                f"{self.root} holds a different run ({detail}); resuming would mix states of two runs "
                "in one dataset: use a new --output"
            )
        if record and any(k not in old for k in engine_info):
            atomic_write(run_file, json.dumps({**old, **engine_info}, indent=2, sort_keys=True).encode())

    def _compare(self, old: dict, run_info: dict, fingerprints: dict | None) -> dict:
        """run.json to keep after comparing the recorded run with this one (OutputError if they differ)."""
        from ...checkpoint import describe_model_change
        from ..dataset import describe_input_change

        old_fp = old.get("fingerprints") or {}
        describers = {"model": describe_model_change, "input": describe_input_change}
        same_files = {
            k
            for k in describers
            if fingerprints and k in old_fp and k in fingerprints and not describers[k](old_fp[k], fingerprints[k])
        }
        diff = {k: (old.get(k), v) for k, v in run_info.items() if k in old and old.get(k) != v and k not in same_files}
        # a first run that stopped before its engine started has no dtype yet: not a difference
        diff.update({k: (None, v) for k, v in run_info.items() if k not in old and k != "dtype"})
        diff.pop("world_size", None)
        if old.get("world_size", 1) != run_info.get("world_size", 1):  # (absent: one engine)
            diff["world_size"] = (old.get("world_size", 1), run_info.get("world_size", 1))
        # the parts of a sharded run are cut by batch: every rank must cut the same way
        resumable = self.RESUMABLE_CHANGES if not self.part.sharded and "world_size" not in diff else {}
        for k in [k for k in diff if k in resumable]:
            a, b = diff.pop(k)
            logger.warning(
                "resuming %s with %s %r (the run that made it used %r): %s",
                self.root,
                k,
                b,
                a,
                resumable[k],
            )
        for k in same_files:
            if old.get(k) != run_info.get(k):
                logger.warning(
                    "resuming %s with the %s at %s (the run that made it read %s): the same files, "
                    "by their fingerprint",
                    self.root,
                    k,
                    run_info.get(k),
                    old.get(k),
                )
        changes = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()]
        if fingerprints:
            if not old_fp:
                logger.warning(
                    "%s was made without fingerprints of its model and input: whether they changed "
                    "since cannot be checked; recording them now",
                    self.root,
                )
            for k, describe in describers.items():
                if k in old_fp and k in fingerprints and k not in same_files:
                    changes += [f"{k} {run_info.get(k)}: {c}" for c in describe(old_fp[k], fingerprints[k])]
        if changes:
            if self.part.sharded or old.get("world_size", 1) > 1:
                raise OutputError(
                    f"{self.part.label}: {self.root} holds a sharded run made with other settings "
                    f"({'; '.join(changes)}); every rank must run with the same settings (the run.json "
                    "there), else the parts would not add up to one dataset"
                )
            raise OutputError(
                f"{self.root} holds a different run ({'; '.join(changes)}); resuming would mix "
                "states of two runs in one dataset: use a new --output"
            )
        keep = {k: v for k, v in old.items() if k not in self.LATEST}
        keep.update({k: v for k, v in run_info.items() if k not in keep})
        if fingerprints:
            # (the same files: this run's fingerprint, whose modification times are the files' now)
            keep["fingerprints"] = {**old_fp, **fingerprints}
            keep["model"], keep["input"] = (
                run_info.get("model", old.get("model")),
                run_info.get("input", old.get("input")),
            )
        return keep

    # -- the files already written -------------------------------------------------------------------

    def check_existing(self, verify_all: bool = False, recent: bool = True) -> list[str]:
        """Remove the finished files a resume must not trust, so that they are computed again, and
        return their names (each one logged with the reason): a file with no checksums.jsonl record
        (a crash between its rename and its record), one whose size differs from its record, one
        changed since it was written (its modification time differs) whose checksum no longer
        matches, and one written in the last RECENT_S seconds of the run before (with ``recent``:
        that run did not finish), or with ``verify_all`` any, whose checksum does not match."""
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
            tail = recent and "mtime_ns" in rec and rec["mtime_ns"] >= last - int(self.RECENT_S * 1e9)
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

    # -- a sharded run's parts ------------------------------------------------------------------------

    def mark_done(self, n_samples: int, extra: dict, summary: dict) -> None:
        """This rank finished its part: ``rank_{K}/done.json`` (after its files are durable)."""
        sync_filesystem(self.root)
        info = {"rank": self.part.rank, "world_size": self.part.world_size, "samples": n_samples, "extra": extra}
        info["summary"] = summary
        atomic_write(self.records / "done.json", json.dumps(info, indent=1, sort_keys=True).encode())

    def ranks_done(self) -> dict[int, dict]:
        """rank -> its done.json, for the ranks of this run that finished their part."""
        out = {}
        for r in range(self.part.world_size):
            try:
                out[r] = json.loads((self.root / f"rank_{r}" / "done.json").read_text())
            except (OSError, ValueError):
                continue
        return out

    def finalize_if_complete(self) -> dict | None:
        """Write the whole dataset's manifest if every rank has finished its part (the last to
        finish does it; under ``.run.lock``, so two finishing together write it once). Returns
        the manifest, or None while ranks are missing."""
        with self._run_json_lock():
            done = self.ranks_done()
            if len(done) < self.part.world_size or (self.root / "manifest.json").exists():
                return None
            return self.finalize(done[0]["samples"], merged_extra(done))

    def finalize(self, n_samples: int, extra: dict) -> dict:
        """Write manifest.json over every complete file (rehashing any missing checksum, e.g. of
        files an earlier run wrote with another algorithm); of a sharded run, every rank's files."""
        sums = self.checksum_records(all_ranks=True)
        files = []
        for i in range(0, n_samples, self.shard_size):
            name = file_name(i, self.fmt) if self.shard_size == 1 else shard_name(i // self.shard_size)
            p = self.root / name
            if not p.exists():
                continue
            rec = sums.get(i)
            algo = self.checksum or DEFAULT_CHECKSUM
            if rec is None or rec.get("bytes") != p.stat().st_size or (algo != "none" and not rec.get(algo)):
                rec = {
                    "index": i,
                    "file": name,
                    "bytes": p.stat().st_size,
                    "tokens": rec.get("tokens") if rec else None,
                    **({"samples": rec["samples"]} if rec and "samples" in rec else {}),
                }
                if algo != "none":
                    rec[algo] = file_digest(p, algo)
            # (a write time is the run's, not the dataset's: the manifest of a resumed dataset is
            # byte-identical to an uninterrupted one's)
            rec = {k: v for k, v in rec.items() if (k not in CHECKSUMS or k == algo) and k != "mtime_ns"}
            files.append(rec)
        if self.fmt == "pt" and self.shard_size == 1 and all(f.get("tokens") is not None for f in files):
            # speculators 0.4.x's trainer batches by these lengths (without them it guesses from
            # file sizes); its offline script writes the same file
            lengths = {str(f["index"]): f["tokens"] for f in files}
            atomic_write(self.root / "sample_lengths.json", json.dumps(lengths, indent=1).encode())
        dataset = None
        where = Layout.of_states(self.root, self.fmt).trainer_dataset
        if where is not None:  # its trainer's input_ids/loss_mask dataset (speculators-hs)
            from .trainer_dataset import write_dataset

            run = json.loads((self.root / "run.json").read_text())
            algo = self.checksum or DEFAULT_CHECKSUM
            dataset = write_dataset(where, run["input"], n_samples, run["max_model_len"], algo)
            dataset = {"path": os.path.relpath(where, self.root), **dataset}
        t = time.perf_counter()
        sync_filesystem(self.root)  # the files are durable before the manifest says the dataset is complete
        self.sync_s = time.perf_counter() - t
        manifest = dict(extra)
        if self.shard_size > 1:
            manifest["shard_size"] = self.shard_size
        if dataset is not None:
            manifest["dataset"] = dataset
        manifest.update(
            {
                "format": self.fmt,
                "checksum": self.checksum or DEFAULT_CHECKSUM,
                "num_files": len(files),
                "total_bytes": sum(f["bytes"] for f in files),
                "total_tokens": sum(f["tokens"] or 0 for f in files),
                "files": files,
            }
        )
        atomic_write(self.root / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
        return manifest


def sync_filesystem(path: Path) -> None:
    """Write back the filesystem holding ``path`` (Linux syncfs; elsewhere sync)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass  # (no syncfs here: the portable call below does it for every filesystem)
    os.sync()

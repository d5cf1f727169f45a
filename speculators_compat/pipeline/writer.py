"""Output directory: speculators 0.3.0's layout, written atomically, resumable.

    OUT/data_{i}.pt           {"input_ids": LongTensor[T], "hidden_states": [Tensor[T, H] per layer],
                               "loss_mask": LongTensor[T]}   (torch.save's bytes, built by ptfile;
                                                             speculators' trainer reads it)
    OUT/data_{i}.safetensors  the same as safetensors (hidden_states_0..L-1), with --format safetensors
    OUT/run.json              what this output is (model, layer ids, input, versions): a rerun with
                              different settings is refused instead of mixing data
    OUT/checksums.jsonl       one line per finished file: index, name, checksum, bytes, tokens
    OUT/manifest.json         written at the end: counts and every file's checksum, sorted by index

The checksum is ``crc32`` (zlib's CRC-32, as zip and gzip use; the default), ``sha256`` or ``none``;
each record names its algorithm by its key (``"crc32": 8 hex digits`` or ``"sha256": hex``). The
default is crc32 because it was measured: sha256 needs ~3x the CPU, and on an H200 host the
pipeline kept 0.861-0.886 of generate() with it against 0.888-0.903 with crc32 in the same three
runs (docs/gpu-results.md section 10). A ``data_{i}.pt`` file's crc32 is made from the CRCs its zip
records already hold (crc.of_parts): the states are not read a second time. A rerun into an existing output keeps the algorithm it finds there unless told
otherwise (the manifest then rehashes the earlier files, so it never mixes algorithms).

Every data file is written to a temp name (``.data_{i}.pt.partial``: not ``*pt``, so the trainer never
sees it) and renamed into place. A sample is complete iff its final file exists. Writes happen on a
background thread fed by a bounded queue, so disk I/O overlaps the next batch's compute and host
memory holds at most ``queue_size`` batches.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import re
import threading
import zlib
from pathlib import Path
from typing import Any

from . import crc, ptfile

logger = logging.getLogger("speculators_compat.pipeline")

DATA_FILE_RE = re.compile(r"^data_(\d+)\.(pt|safetensors)$")


class OutputError(RuntimeError):
    pass


def file_name(index: int, fmt: str) -> str:
    return f"data_{index}.{fmt}"


CHECKSUMS = ("crc32", "sha256", "none")
DEFAULT_CHECKSUM = "crc32"


class _Crc32:
    """zlib.crc32 behind hashlib's update/hexdigest (zlib releases the GIL on large buffers too)."""

    def __init__(self, data=b""):
        self.v = zlib.crc32(data)

    def update(self, b) -> None:
        self.v = zlib.crc32(b, self.v)

    def hexdigest(self) -> str:
        return f"{self.v:08x}"


class _NoDigest:
    def update(self, b) -> None:
        pass

    def hexdigest(self) -> None:
        return None


def check_checksum(name: str | None, allow_none: bool = True) -> str | None:
    """``name`` if it is a known checksum (None, where ``allow_none``: choose later, see
    OutputDir); else ValueError naming the choices."""
    if name not in CHECKSUMS and not (allow_none and name is None):
        raise ValueError(f"checksum must be one of {', '.join(CHECKSUMS)}, not {name!r}")
    return name


def new_digest(name: str, data=b""):
    """A running checksum of ``name`` (see CHECKSUMS) over ``data`` so far."""
    check_checksum(name, allow_none=False)  # by now the algorithm is chosen: None is a bug, not "none"
    if name == "sha256":
        return hashlib.sha256(data)
    return _Crc32(data) if name == "crc32" else _NoDigest()


def file_digest(path: Path, name: str) -> str | None:
    """``name`` checksum of the file at ``path``, read in 8 MiB pieces."""
    h = new_digest(name)
    if name != "none":
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, f, checksum: str = DEFAULT_CHECKSUM):
        self.f, self.h, self.n = f, new_digest(checksum), 0

    def writable(self):
        return True

    def write(self, b):
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)


def write_sample(path: Path, sample: dict[str, Any], fmt: str, checksum: str = DEFAULT_CHECKSUM) -> tuple[str | None, int]:
    """Write ``sample`` atomically to ``path``; returns (checksum hex or None, bytes). A ``pt`` sample
    is built by :mod:`ptfile` (torch.save's bytes, written from the states' own memory: 0.29-0.30
    against 0.46 ms a tiny-model file) unless it declines. Otherwise a sample whose states exceed
    ``SMALL_SAMPLE_BYTES`` streams torch.save into the file through a hash (no in-memory copy); a
    smaller one is serialised in memory and written with one call. All give the same bytes."""
    if fmt == "pt":
        parts = ptfile.encode(sample)  # torch.save's bytes, built directly; None: torch.save must write it
        if parts is not None:
            if checksum == "crc32":  # from the records' own CRCs: the states are not read again
                digest = f"{crc.of_parts(parts, parts.known_crcs):08x}"
            else:
                h = new_digest(checksum)
                for p in parts:
                    h.update(p)
                digest = h.hexdigest()
            return digest, write_parts(path, parts)
        sample = _unowned_states(sample)
    if fmt != "pt" or _payload_bytes(sample) <= SMALL_SAMPLE_BYTES:
        # safetensors, or a small sample: serialise in memory, write once, hash the same bytes
        # (torch.save streaming into a file makes ~64 small writes a file)
        data = _safetensors_bytes(sample) if fmt != "pt" else _torch_bytes(sample)
        atomic_write(path, data)
        return new_digest(checksum, data).hexdigest(), len(data)
    import torch

    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        hf = _HashingFile(f, checksum)
        torch.save(sample, hf)
    os.replace(tmp, path)
    return hf.h.hexdigest(), hf.n


def _unowned_states(sample: dict[str, Any]) -> dict[str, Any]:
    """``sample`` with each hidden state replaced by a tensor over the same bytes that owns no
    reference to the original storage.

    torch.save in torch 2.8 and 2.9 (not 2.10 or 2.13: checked) builds a local pickler class per
    call whose closure holds every storage it saved; a class always sits in a reference cycle,
    so those storages stay referenced until the cyclic GC frees that cycle, which may already be
    in the oldest generation by then (seen: the engine's lent rows stayed "busy" after the
    pipeline had dropped them). Saving aliases keeps the caller's storages out of that cycle.
    Only a state whose storage is exactly its bytes is aliased, and one alias per storage, so the
    file is byte-identical to saving the original; the caller holds ``sample`` for the whole
    save, so the memory stays valid while the alias is read, and nothing reads it afterwards."""
    import ctypes

    import torch

    aliases: dict[tuple, Any] = {}  # a tensor listed twice stays one storage in the file

    def alias(h):
        if (not isinstance(h, torch.Tensor) or h.device.type != "cpu" or not ptfile.owns_its_storage(h)
                or h.requires_grad):  # (an alias would drop the flag, which torch.save keeps)
            return h
        nbytes = h.numel() * h.element_size()
        key = (h.data_ptr(), h.dtype, tuple(h.shape))
        if key not in aliases:
            raw = (ctypes.c_ubyte * nbytes).from_address(h.data_ptr())
            aliases[key] = torch.frombuffer(raw, dtype=torch.uint8).view(h.dtype).view(h.shape)
        return aliases[key]

    return {**sample, "hidden_states": [alias(h) for h in sample["hidden_states"]]}


def _torch_bytes(sample: dict[str, Any]) -> memoryview:
    import torch

    buf = io.BytesIO()
    torch.save(sample, buf)
    return buf.getbuffer()  # no copy of the serialised bytes


SMALL_SAMPLE_BYTES = 1 << 20


def _payload_bytes(sample: dict[str, Any]) -> int:
    return sum(h.numel() * h.element_size() for h in sample["hidden_states"])


def _safetensors_bytes(sample: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    tensors = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
    tensors.update(distinct_states("hidden_states_{}", sample["hidden_states"]))
    return save(tensors)


def distinct_states(name: str, states) -> dict[str, Any]:
    """``{name.format(j): state}`` with every state contiguous and in memory of its own.
    safetensors refuses to save two tensors over the same memory, and a layer id listed twice
    gives one state twice: upstream's default ids [2, n//2, n-3, n-1] repeat 3 on a 6-layer model
    (and 2 on a 5-layer one). A repeat is saved as a copy; the file holds both entries."""
    out, seen = {}, set()
    for j, h in enumerate(states):
        h = h.contiguous()
        if h.numel() and h.data_ptr() in seen:
            h = h.clone()
        seen.add(h.data_ptr())
        out[name.format(j)] = h
    return out


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    write_parts(path, [data])


_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
_IOV_MAX = 512


def write_parts(path: Path | str, parts: list) -> int:
    """Write the buffers ``parts`` one after another to ``path`` atomically (a temp name, then a
    rename: a crash leaves either no file or the whole file); returns the bytes written. Plain
    os calls and one writev per 512 buffers: the per-file cost matters at thousands of files a
    second."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.partial")
    views = [v.cast("B") for v in map(memoryview, parts) if v.nbytes]  # (sliced by bytes below)
    total, i = 0, 0
    fd = os.open(tmp, _O_NEW, 0o666)
    try:
        try:
            while i < len(views):
                n = os.writev(fd, views[i:i + _IOV_MAX])
                total += n
                while n:  # a short write: drop what went out, go on with the rest
                    if n >= views[i].nbytes:
                        n -= views[i].nbytes
                        i += 1
                    else:
                        views[i], n = views[i][n:], 0
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # (the error that matters is the one being raised)
            os.unlink(tmp)
        raise
    return total


def _shard_name(k: int) -> str:
    from .shards import shard_name

    return shard_name(k)


class OutputDir:
    def __init__(self, root: str | Path, fmt: str = "pt", checksum: str | None = None, shard_size: int = 1):
        """``checksum``: see CHECKSUMS; None: the one an earlier run used here, else DEFAULT_CHECKSUM.
        ``shard_size`` > 1: safetensors shards of that many samples (pipeline/shards.py)."""
        self.root = Path(root)
        self.fmt = fmt
        self.checksum = check_checksum(checksum)
        self.shard_size = shard_size
        self._lock_fd: int | None = None

    #: run settings a resume may change (run.json keeps the first run's), and what changing them means
    RESUMABLE_CHANGES = {
        "batch_size": "the samples computed now share steps with other neighbours, so their states may "
                      "differ in the last bits from an uninterrupted run's (vLLM is not batch-invariant); "
                      "they are as right (a lower --batch-size is the way out of a memory error)"}
    #: run.json keys that describe the latest run rather than the dataset: rewritten, never compared
    LATEST = ("samples", "skipped_overlength", "input_scan")
    #: files written within this many seconds of an earlier run's last file are checksummed on
    #: resume: what a crash or a power cut can hurt (the kernel writes dirty pages back within ~30 s)
    RECENT_S = 60.0

    # -- the lock ---------------------------------------------------------------------------------

    def lock(self) -> None:
        """Create the directory and hold ``.lock`` in it (flock) for this process's lifetime or until
        ``unlock()``: a second extract into the same output is refused, naming the first. Also
        proves the directory writable before anything else happens."""
        import fcntl
        import socket
        import time

        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory {self.root}: {e.strerror}") from e
        path = self.root / ".lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise OutputError(f"output directory {self.root} is not writable: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise OutputError(f"{self.root} is being written by another extract ({holder}): wait for it to "
                              "finish, or use another --output") from None
        info = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode(), 0)
        except OSError as e:
            os.close(fd)
            raise OutputError(f"output directory {self.root} is not writable: {e.strerror}") from e
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)  # (closing releases the flock)
            self._lock_fd = None

    # -- what this output is ------------------------------------------------------------------------

    def recorded(self) -> dict:
        """run.json as the last run left it ({} if there is none or it is unreadable)."""
        try:
            return json.loads((self.root / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    def prepare(self, run_info: dict, total: int | None = None, fingerprints: dict | None = None,
                latest: dict | None = None, verify_existing: bool = False) -> set[int]:
        """Create/validate the directory; drop partial and damaged files; return indices already
        complete (``total``: the samples this run reads, if known; it decides whether a short last
        shard is done). ``fingerprints``: {"model": ..., "input": ...} of what the states depend on;
        a resume whose fingerprints differ from the recorded ones is refused, naming what changed
        (paths may change when the files are the same). ``latest``: run.json keys of LATEST.
        ``verify_existing``: checksum every finished file, not only those a crash may have hurt."""
        if self._lock_fd is None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise OutputError(f"cannot create output directory {self.root}: {e.strerror}") from e
        if not os.access(self.root, os.W_OK):
            raise OutputError(f"output directory {self.root} is not writable")
        run_file = self.root / "run.json"
        if run_file.exists():
            try:
                old = json.loads(run_file.read_text())
            except ValueError as e:
                raise OutputError(f"{run_file}: unreadable ({e}); is {self.root} an extract output?") from None
            record = self._compare(old, run_info, fingerprints)
        else:
            foreign = sorted(p.name for p in self.root.iterdir() if not p.name.startswith("."))
            if foreign:
                raise OutputError(f"{self.root} is not empty ({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}) "
                                  "and holds no run.json, so it is no extract output: use a new or empty --output")
            record = dict(run_info, **({"fingerprints": fingerprints} if fingerprints else {}))
        record.update(latest or {})
        atomic_write(run_file, json.dumps(record, indent=2, sort_keys=True).encode())
        if self.checksum is None:
            earlier = next(iter(self.checksum_records().values()), None)  # an earlier run's choice
            self.checksum = (next((k for k in CHECKSUMS if k in earlier), "none") if earlier
                             else DEFAULT_CHECKSUM)
        for pattern in (".data_*.partial", ".shard_*.partial"):
            for p in self.root.glob(pattern):
                logger.info("removing partial file %s from an interrupted run", p.name)
                p.unlink()
        manifest = self.root / "manifest.json"
        records = self.checksum_records()
        last = max((r.get("mtime_ns", 0) for r in records.values()), default=0)
        # a run that finished made its files durable (finalize) and then wrote the manifest: only a
        # run that did not finish leaves recent files that a crash may have hurt
        finished = manifest.exists() and manifest.stat().st_mtime_ns >= last
        self.check_existing(verify_existing, recent=not finished)
        manifest.unlink(missing_ok=True)  # (this run writes it when it finishes: till then the dataset is incomplete)
        if self.shard_size > 1:
            from .shards import done_from_shards

            return done_from_shards(self.root, self.shard_size, total)
        done = set()
        for p in self.root.iterdir():
            m = DATA_FILE_RE.match(p.name)
            if m and m.group(2) == self.fmt:
                done.add(int(m.group(1)))
        return done

    def confirm(self, engine_info: dict) -> None:
        """After the engine started: what only the engine knows (the dtype it chose for "auto") must
        match what run.json recorded; a first run records it."""
        run_file = self.root / "run.json"
        old = json.loads(run_file.read_text())
        diff = {k: (old[k], v) for k, v in engine_info.items() if k in old and old[k] != v}
        if diff:
            detail = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise OutputError(f"{self.root} holds a different run ({detail}); use a new --output")
        if any(k not in old for k in engine_info):
            atomic_write(run_file, json.dumps({**old, **engine_info}, indent=2, sort_keys=True).encode())

    def _compare(self, old: dict, run_info: dict, fingerprints: dict | None) -> dict:
        """run.json to keep after comparing the recorded run with this one (OutputError if they differ)."""
        from ..checkpoint import describe_model_change
        from .dataset import describe_input_change

        old_fp = old.get("fingerprints") or {}
        same_files = {k for k in ("model", "input")
                      if fingerprints and k in old_fp and old_fp[k] == fingerprints.get(k)}
        diff = {k: (old.get(k), v) for k, v in run_info.items()
                if k in old and old.get(k) != v and k not in same_files}
        # a first run that stopped before its engine started has no dtype yet: not a difference
        diff.update({k: (None, v) for k, v in run_info.items() if k not in old and k != "dtype"})
        for k in [k for k in diff if k in self.RESUMABLE_CHANGES]:
            a, b = diff.pop(k)
            logger.warning("resuming %s with %s %r (the run that made it used %r): %s", self.root, k, b, a,
                           self.RESUMABLE_CHANGES[k])
        for k in same_files:
            if old.get(k) != run_info.get(k):
                logger.warning("resuming %s with the %s at %s (the run that made it read %s): the same files, "
                               "by their fingerprint", self.root, k, run_info.get(k), old.get(k))
        changes = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()]
        if fingerprints:
            if not old_fp:
                logger.warning("%s was made without fingerprints of its model and input: whether they changed "
                               "since cannot be checked; recording them now", self.root)
            for k, describe in (("model", describe_model_change), ("input", describe_input_change)):
                if k in old_fp and k in fingerprints and old_fp[k] != fingerprints[k]:
                    changes += [f"{k} {run_info.get(k)}: {c}" for c in describe(old_fp[k], fingerprints[k])]
        if changes:
            raise OutputError(f"{self.root} holds a different run ({'; '.join(changes)}); resuming would mix "
                              "states of two runs in one dataset: use a new --output")
        keep = {k: v for k, v in old.items() if k not in self.LATEST}
        keep.update({k: v for k, v in run_info.items() if k not in keep})
        if fingerprints:
            keep["fingerprints"] = {**fingerprints, **{k: v for k, v in old_fp.items() if k in fingerprints}}
            keep["model"], keep["input"] = run_info.get("model", old.get("model")), run_info.get("input", old.get("input"))
        return keep

    # -- the files already written -------------------------------------------------------------------

    def check_existing(self, verify_all: bool = False, recent: bool = True) -> list[str]:
        """Remove the finished files a resume must not trust, so that they are computed again, and
        return their names (each one logged with the reason): a file with no checksums.jsonl record
        (a crash between its rename and its record), one whose size differs from its record, one
        changed since it was written (its modification time differs) whose checksum no longer
        matches, and one written in the last RECENT_S seconds of the run before (with ``recent``:
        that run did not finish), or with ``verify_all`` any, whose checksum does not match."""
        from .shards import SHARD_FILE_RE

        pattern = SHARD_FILE_RE if self.shard_size > 1 else DATA_FILE_RE
        files = [p for p in self.root.iterdir() if pattern.match(p.name)
                 and (self.shard_size > 1 or DATA_FILE_RE.match(p.name).group(2) == self.fmt)]
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
                bad.append((p, f"its {algo} differs from the one recorded when it was written"
                               + (" (the file was modified since)" if changed else "")))
        for p, why in bad:
            logger.warning("%s: %s; computing it again", p.name, why)
            p.unlink()
        return [p.name for p, _ in bad]

    def checksum_records(self) -> dict[int, dict]:
        """index -> the checksums.jsonl record of each finished file (a torn line is skipped)."""
        out: dict[int, dict] = {}
        f = self.root / "checksums.jsonl"
        if f.exists():
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash (finalize rehashes that file)
                out[rec["index"]] = rec
        return out

    def finalize(self, n_samples: int, extra: dict) -> dict:
        """Write manifest.json over every complete file (rehashing any missing checksum, e.g. of
        files an earlier run wrote with another algorithm)."""
        sums = self.checksum_records()
        files = []
        for i in range(0, n_samples, self.shard_size):
            name = file_name(i, self.fmt) if self.shard_size == 1 else _shard_name(i // self.shard_size)
            p = self.root / name
            if not p.exists():
                continue
            rec = sums.get(i)
            algo = self.checksum or DEFAULT_CHECKSUM
            if rec is None or rec.get("bytes") != p.stat().st_size or (algo != "none" and not rec.get(algo)):
                rec = {"index": i, "file": name, "bytes": p.stat().st_size,
                       "tokens": rec.get("tokens") if rec else None,
                       **({"samples": rec["samples"]} if rec and "samples" in rec else {})}
                if algo != "none":
                    rec[algo] = file_digest(p, algo)
            # (a write time is the run's, not the dataset's: the manifest of a resumed dataset is
            # byte-identical to an uninterrupted one's)
            rec = {k: v for k, v in rec.items() if (k not in CHECKSUMS or k == algo) and k != "mtime_ns"}
            files.append(rec)
        sync_filesystem(self.root)  # the files are durable before the manifest says the dataset is complete
        manifest = dict(extra)
        if self.shard_size > 1:
            manifest["shard_size"] = self.shard_size
        manifest.update({"format": self.fmt, "checksum": self.checksum or DEFAULT_CHECKSUM, "num_files": len(files),
                         "total_bytes": sum(f["bytes"] for f in files),
                         "total_tokens": sum(f["tokens"] or 0 for f in files), "files": files})
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


class _ChecksumLog:
    """``checksums.jsonl``: one line per finished file, appended as files complete (both writers).
    Not locked: callers serialise ``add``."""

    def __init__(self, out: OutputDir):
        self.fmt, self.checksum, self.root = out.fmt, out.checksum or DEFAULT_CHECKSUM, out.root
        self.f = open(out.root / "checksums.jsonl", "a", encoding="utf-8")
        self.written = 0
        self.bytes = 0  # of the files this run wrote

    def add(self, index: int, digest: str | None, nbytes: int, tokens: int, file: str | None = None,
            samples: int | None = None) -> None:
        """``file``/``samples``: a shard's name and sample count (its ``index`` is its first sample)."""
        name = file or file_name(index, self.fmt)
        rec = {"index": index, "file": name, "bytes": nbytes, "tokens": tokens}
        try:  # the file's write time: a resume checks that the file has not changed since (OutputDir)
            rec["mtime_ns"] = os.stat(self.root / name).st_mtime_ns
        except OSError:
            pass
        if samples is not None:
            rec["samples"] = samples
        if digest is not None:
            rec[self.checksum] = digest
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.written += 1
        self.bytes += nbytes

    def close(self) -> None:
        self.f.close()


def default_writer_threads() -> int:
    """Half the CPUs, 2..8 (1 on one CPU). Each thread streams torch.save through the file's
    checksum (with sha256 ~0.6-1 GiB/s a thread); an H200 host's generate() outruns 4 of them
    (docs/gpu-results.md)."""
    from ..engine.core import usable_cpus

    cpus = usable_cpus()
    return min(8, max(min(2, cpus), cpus // 2))


class _Writer:
    """What the pipeline's writers share: the first failure, which ``check()`` raises to the
    producer, and the counts of what this run wrote (from its checksum log)."""

    error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise OutputError(f"writing to {self.out.root} failed: {self.error}") from self.error

    @property
    def written(self) -> int:
        return self._sums.written

    @property
    def bytes_written(self) -> int:
        return self._sums.bytes

    def finish(self, n_samples: int) -> None:
        """The run handed over all it will (``n_samples`` read). Only the shard writer needs to
        know; ``upto`` in ``put`` likewise (every index below it has been handed over)."""

    def _consume(self, handle) -> None:
        """A writer thread's loop: ``handle`` each message from ``self.q`` until None. The first
        failure (disk full, permissions) is kept for ``check()``; later messages are drained
        unhandled, so the producer never blocks on a queue nobody empties."""
        while True:
            msg = self.q.get()
            if msg is None:
                return
            if self.error is not None:
                continue
            try:
                handle(msg)
            except BaseException as e:
                self.error = e


class BackgroundWriter(_Writer):
    """Writes (index, sample) items on a thread; ``queue_size`` bounds what waits in memory."""

    def __init__(self, out: OutputDir, queue_size: int = 2, threads: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.out = out
        self.q: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.error: BaseException | None = None
        self.wait_s = 0.0  # time put() spent waiting for room in the queue
        self.tail_s = 0.0  # time close() spent waiting for the last writes
        self.start_wait_s = 0.0  # (threads start at once; see ProcessWriter)
        self._sums = _ChecksumLog(out)
        self._lock = threading.Lock()
        # Files of one batch are written in parallel (hashing and file writes release the GIL);
        # the next batch waits, so memory stays bounded by queue_size + 1 batches.
        n = threads if threads is not None else default_writer_threads()
        if n < 1:
            raise ValueError(f"writer threads must be >= 1, not {n}")
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="speculators-compat-write") if n > 1 else None
        self._t = threading.Thread(target=self._loop, name="speculators-compat-writer", daemon=True)
        self._t.start()

    def put(self, items: list[tuple[int, dict]], upto: int | None = None) -> None:
        """Queue one batch's samples (blocks while the queue is full); re-raises a writer failure."""
        import time

        self.check()
        t = time.perf_counter()
        self.q.put(items)
        self.wait_s += time.perf_counter() - t

    def _loop(self) -> None:
        self._consume(self._write_batch)

    def _write_batch(self, items: list[tuple[int, dict]]) -> None:
        if self._pool is None:
            for item in items:
                self._write_one(item)
        else:
            for f in [self._pool.submit(self._write_one, item) for item in items]:
                f.result()  # re-raises the first failure

    def _write_one(self, item: tuple[int, dict]) -> None:
        index, sample = item
        digest, nbytes = write_sample(self.out.root / file_name(index, self.out.fmt), sample, self.out.fmt,
                                      self._sums.checksum)
        with self._lock:
            self._sums.add(index, digest, nbytes, int(sample["input_ids"].numel()))

    def close(self) -> None:
        import time

        t = time.perf_counter()
        self.q.put(None)
        self._t.join()
        self.tail_s = time.perf_counter() - t
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._sums.close()
        self.check()


class WriterProcessDied(OutputError):
    pass


def _died(proc, exitcode) -> WriterProcessDied:
    return WriterProcessDied(f"writer process {proc.name} (pid {proc.pid}) died with exit code {exitcode}; "
                             "files already written are complete, rerun to resume")


WRITER_NICE_ENV = "SPECULATORS_COMPAT_WRITER_NICE"


def _writer_nice() -> int | str:
    """How much lower the writer processes' CPU priority is: an ``os.nice`` increment 0..19, or
    ``idle`` (Linux SCHED_IDLE: they run on cores nothing else wants). Env
    SPECULATORS_COMPAT_WRITER_NICE, default 0; read when the writer processes start."""
    raw = os.environ.get(WRITER_NICE_ENV, "").strip()
    if not raw:
        return 0
    if raw == "idle":
        if not hasattr(os, "SCHED_IDLE"):
            raise ValueError(f"{WRITER_NICE_ENV}=idle needs Linux SCHED_IDLE, which this platform lacks")
        return raw
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= 19:
        raise ValueError(f"{WRITER_NICE_ENV} must be an integer 0..19 (a niceness increment) or idle, not {raw!r}")
    return n


def default_writer_processes(gpu_workers: int | None = None) -> int:
    """On a GPU host, every CPU but two (the driver, and one spare for the read-ahead thread, the
    kernel's writeback and whatever else the host runs) and one per engine worker (the driver and
    the workers spin while the GPUs work), 2..16. On the 16-core H200 host (TP 1) that is 13:
    with 13 the pipeline reached 0.934 and 0.908 of ``generate()`` over 40 batches against 0.897
    with 14 in the same run, whose last files took as long (0.078 against 0.076 s); 4 and 8 were
    far too few (docs/gpu-results.md sections 8, 9 and 11). ``gpu_workers`` is the engine's
    tensor-parallel size (default 1). Elsewhere half the CPUs, 2..16: a CPU engine needs its
    cores."""
    from ..engine.core import usable_cpus
    from ..generator import cuda_device_count

    cpus = usable_cpus()
    if cuda_device_count() > 0:
        return max(2, min(16, cpus - 2 - (gpu_workers or 1)))
    return max(2, min(16, cpus // 2))


# ------------------------------------------------------------------ writer processes
#
# The driver talks to each writer process over two pipes of its own and no helper thread: the
# driver's thread spins on vLLM's reply queue while the engine works, and any other thread of the
# driver that needs the GIL (a multiprocessing.Queue feeder, a result collector) then waits for
# the interpreter's forced switch (5 ms each time) behind it. Tasks are written by the caller
# itself, without blocking (what does not fit in the pipe is kept and written at the next
# chance); results are read by the caller when it queues the next batch (right before the next
# engine call, which is when the engine needs to know which rows are free) or waits.

_FRAME = 8  # bytes of the little-endian length that precedes each pickled task
PIPE_BYTES = 1 << 20  # asked for each task pipe (Linux: F_SETPIPE_SZ, up to pipe-max-size)


def _grow_pipe(fd: int) -> int:
    """Make the pipe at ``fd`` hold PIPE_BYTES if the OS lets us; returns its size (0 if unknown)."""
    import fcntl

    setsz = getattr(fcntl, "F_SETPIPE_SZ", None)
    getsz = getattr(fcntl, "F_GETPIPE_SZ", None)
    if setsz is None:
        return 0
    for size in (PIPE_BYTES, 1 << 18, 1 << 16):
        try:
            fcntl.fcntl(fd, setsz, size)
            break
        except OSError:  # above /proc/sys/fs/pipe-max-size: try smaller
            continue
    return fcntl.fcntl(fd, getsz) if getsz is not None else 0


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd`` (blocking), or None at end of file (the driver closed its end)."""
    parts, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _writer_process_main(task_conn, result_conn) -> None:
    """A writer process: maps the engine's arena files and writes each sample it is sent.

    A task names where each layer's rows lie ((file, byte offset, rows) in /dev/shm); the rows
    are read in place, so they cross no pipe. The driver keeps them lent (the engine does not
    reuse that memory) until this process reports the file written. It exits when the driver
    sends None or closes its end of the task pipe (it died).
    """
    import gc
    import mmap
    import pickle

    import numpy as np
    import select

    import torch

    torch.set_num_threads(1)
    niceness = _writer_nice()
    if niceness == "idle":  # background work: where cores are short, the engine's processes go first
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif niceness:
        os.nice(niceness)
    parent = os.getppid()
    fd = task_conn.fileno()
    maps: dict[str, mmap.mmap] = {}
    while True:
        if not select.select([fd], [], [], 2)[0]:
            # (a process forked from the driver, e.g. an engine worker, may hold the pipe's
            # other end too, so end-of-file alone does not prove the driver is gone)
            if os.getppid() != parent:
                return
            continue
        head = _read_exact(fd, _FRAME)
        body = _read_exact(fd, int.from_bytes(head, "little")) if head is not None else None
        if body is None:
            return
        task = pickle.loads(body)
        if task is None:
            return
        if task == "ping":  # _WriterPool.wait_ready: torch is imported, tasks are read
            result_conn.send(("pong", []))
            continue
        root, fmt, checksum, entries = task
        done = []
        for index, input_ids, loss_mask, blocks, hidden, dtype_name in entries:
            layers = sample = buf = None
            try:
                dtype = getattr(torch, dtype_name)
                layers = []
                for path, off, rows in blocks:
                    mm = maps.get(path)
                    if mm is None:
                        with open(path, "r+b") as f:
                            mm = maps[path] = mmap.mmap(f.fileno(), 0)
                    buf = np.frombuffer(mm, dtype=np.uint8, count=rows * hidden * dtype.itemsize, offset=off)
                    layers.append(torch.from_numpy(buf).view(dtype).view(rows, hidden))
                sample = {"input_ids": torch.from_numpy(input_ids), "hidden_states": layers,
                          "loss_mask": torch.from_numpy(loss_mask)}
                digest, nbytes = write_sample(Path(root) / file_name(index, fmt), sample, fmt, checksum)
                done.append((index, digest, nbytes, int(input_ids.size)))
            except BaseException as e:  # reported to the driver, which stops the run
                result_conn.send(("error", done, index, f"{type(e).__name__}: {e}"))
                done = None
                break
            finally:
                layers = sample = buf = None
        if done is not None:
            result_conn.send(("ok", done))  # one message a task
        gc.collect(1)  # cycles made while writing (write_sample keeps the mapped rows out of torch.save's)
        for p in [p for p in maps if not os.path.exists(p)]:  # the engine released that arena file
            try:
                maps.pop(p).close()
            except BufferError:  # still referenced (cannot happen once the sample is dropped)
                pass


class _WriterProc:
    """One writer process and the driver's ends of its two pipes."""

    def __init__(self, ctx, i: int):
        task_r, self.task_w = ctx.Pipe(duplex=False)
        self.results, result_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_writer_process_main, name=f"speculators-compat-write-{i}",
                                args=(task_r, result_w), daemon=True)
        self.proc.start()
        task_r.close()  # the child's ends: when the driver dies, the child reads end-of-file
        result_w.close()
        self.fd = self.task_w.fileno()
        self.pipe_bytes = _grow_pipe(self.fd)
        os.set_blocking(self.fd, False)
        self.outbox = bytearray()  # framed tasks not yet in the pipe
        self.load = 0  # bytes of states sent and not yet reported written
        self.answered = False  # it has sent something back: started (torch imported), reading tasks

    def send(self, obj) -> None:
        import pickle

        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.outbox += len(body).to_bytes(_FRAME, "little") + body
        self.flush()

    def flush(self) -> bool:
        """Write what the pipe takes now; True when nothing is left to write."""
        while self.outbox:
            try:
                n = os.write(self.fd, self.outbox)
            except BlockingIOError:
                return False
            except BrokenPipeError:  # the process died: reported by the caller's liveness check
                self.outbox.clear()
                return True
            del self.outbox[:n]
        return True


class _WriterPool:
    """Writer processes, started once per driver process and reused by every pipeline run in it
    (starting one costs a torch import, ~1-3 s). Torn down after any failure, so a later run
    never sees an earlier run's results."""

    def __init__(self, n: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        self.n = n
        self.nice = _writer_nice()  # (the processes read it from the environment as they start)
        self.pt_writer = ptfile.mode()  # (the same)
        self.procs = [_WriterProc(ctx, i) for i in range(n)]
        self.lock = threading.Lock()  # one ProcessWriter at a time
        self.broken = False  # a process of it died during a run: never reused

    def dead(self):
        return [w.proc for w in self.procs if not w.proc.is_alive()]

    def wait_ready(self, timeout: float = 120) -> None:
        """Block until every process has started and answers (a process spends ~1-3 s importing
        torch first). Only between runs: it takes the pool's lock."""
        import time
        from multiprocessing.connection import wait

        if not self.lock.acquire(timeout=timeout):
            raise OutputError("writer processes are busy with a run")
        try:
            for w in self.procs:
                w.send("ping")
            deadline = time.monotonic() + timeout
            waiting = {w.results: w for w in self.procs}
            while waiting:
                for w in self.procs:
                    w.flush()
                ready = wait(list(waiting), max(0.0, deadline - time.monotonic()))
                if not ready:
                    names = ", ".join(w.proc.name for w in waiting.values())
                    raise OutputError(f"writer processes did not start within {timeout} s: {names}")
                for conn in ready:
                    w = waiting.pop(conn)
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        raise WriterProcessDied(f"writer process {w.proc.name} died at start-up "
                                                f"(exit code {w.proc.exitcode})") from None
                    if msg[0] != "pong":
                        raise OutputError(f"writer process {w.proc.name} answered {msg[0]!r} to a ping")
                    w.answered = True
        finally:
            self.lock.release()

    def close(self, graceful: bool = True) -> None:
        import time

        if graceful:
            deadline = time.monotonic() + 10
            for w in self.procs:
                try:
                    w.send(None)
                    while not w.flush() and time.monotonic() < deadline and w.proc.is_alive():
                        time.sleep(0.005)
                except OSError:
                    pass
        for w in self.procs:
            if graceful:
                w.proc.join(timeout=10)
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=5)
            w.task_w.close()
            w.results.close()


_POOL: _WriterPool | None = None
_POOL_LOCK = threading.Lock()


def writer_pool(n: int | None = None, gpu_workers: int | None = None) -> _WriterPool:
    """The process-wide writer pool with ``n`` processes (default: default_writer_processes()),
    started now if it is not running (call early to overlap its start with the engine's)."""
    global _POOL
    n = n if n is not None else default_writer_processes(gpu_workers)
    if n < 1:
        raise ValueError(f"writer processes must be >= 1, not {n}")
    nice = _writer_nice()  # a bad setting is an error here, not a dead writer process
    pt_writer = ptfile.mode()  # (the same)
    with _POOL_LOCK:
        if _POOL is not None and (_POOL.n != n or _POOL.broken or _POOL.dead() or _POOL.nice != nice
                                  or _POOL.pt_writer != pt_writer):
            _POOL.close(graceful=not (_POOL.broken or _POOL.dead()))
            _POOL = None
        if _POOL is None:
            _POOL = _WriterPool(n)
        return _POOL


def shutdown_writer_pool(graceful: bool = True) -> None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close(graceful)
            _POOL = None


atexit.register(shutdown_writer_pool)  # let the processes finish and exit before the interpreter


class ProcessWriter(_Writer):
    """Writes samples in separate processes, free of the driver's GIL.

    Why: the engine's driver thread spins on vLLM's shared-memory queue while the GPU works, and
    writer *threads* then wait on the GIL: on an H200 host the thread writer managed ~2.7 GiB/s
    in the pipeline against 6.2 GiB/s alone. Samples whose rows are lent arena blocks (the
    engine's zero-copy hand-off: every prompt, by default) travel as (file, offset, rows); the rest
    (copied rows: zero-copy off, or rows that fell back to several blocks) are written on a local
    thread. Each batch is split over the processes by bytes still to write (least loaded first). The driver holds every sample until its file
    is written, so the engine cannot reuse those rows meanwhile, and at most ``queue_size + 1``
    batches are in flight (bounded memory, as BackgroundWriter). No driver thread is involved
    in talking to the processes (see the comment above ``_FRAME``): results are taken in
    ``put()``, ``written`` and ``close()``. Same files, same bytes, same
    checksums.jsonl as BackgroundWriter.
    """

    def __init__(self, out: OutputDir, describe, queue_size: int = 2, processes: int | None = None,
                 gpu_workers: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = writer_pool(processes, gpu_workers)
        if not self.pool.lock.acquire(timeout=60):
            raise OutputError("another pipeline in this process is using the writer processes")
        self.out, self.describe, self.limit = out, describe, max(1, queue_size) + 1
        self.error: BaseException | None = None
        self.in_processes = 0  # samples sent as (file, offset, rows) to a writer process
        self.on_threads = 0  # samples written on the local thread (rows not lent)
        self.wait_s = 0.0  # time put() spent waiting for a batch in flight to be written
        self.tail_s = 0.0  # time close() spent waiting for the last writes
        # time put() and close() spent waiting while a process had not started yet (its torch
        # import, ~1-3 s): not the disk's doing, so kept out of wait_s and tail_s
        self.start_wait_s = 0.0
        self._sums = _ChecksumLog(out)
        self._cv = threading.Condition()  # the local threads report through it too
        self._pending: dict[int, tuple[int, dict]] = {}  # index -> (batch, sample), until written
        self._sizes: dict[int, tuple[_WriterProc, int]] = {}  # index -> (process, bytes), until written
        self._batches: dict[int, int] = {}  # batch -> samples not yet written
        self._nbatch = 0
        self._local = ThreadPoolExecutor(max_workers=2, thread_name_prefix="speculators-compat-write")
        for w in self.pool.procs:  # a process not yet heard from says when it has started (a pong)
            if not w.answered:
                w.send("ping")

    # -------------------------------------------------------------- producer side
    def put(self, items: list[tuple[int, dict]], upto: int | None = None) -> None:
        """Queue one batch's samples (blocks while ``queue_size + 1`` batches are in flight)."""
        import numpy as np

        self._poll(0)
        while self.error is None and len(self._batches) >= self.limit:
            self._timed_poll("wait_s")
        self.check()
        if not items:
            return
        with self._cv:
            batch = self._nbatch
            self._nbatch += 1
            self._batches[batch] = len(items)
            for index, sample in items:
                self._pending[index] = (batch, sample)
        tasks: dict[int, list] = {}
        procs = self.pool.procs
        for index, sample in items:
            blocks = [self.describe(h) for h in sample["hidden_states"]]
            if all(b is not None for b in blocks):
                h0 = sample["hidden_states"][0]
                size = sum(h.numel() * h.element_size() for h in sample["hidden_states"])
                k = min(range(len(procs)), key=lambda i: procs[i].load)  # least bytes still to write
                procs[k].load += size
                self._sizes[index] = (procs[k], size)
                tasks.setdefault(k, []).append(
                    (index, np.ascontiguousarray(sample["input_ids"].numpy()),
                     np.ascontiguousarray(sample["loss_mask"].numpy()), blocks,
                     int(h0.shape[-1]), str(h0.dtype).replace("torch.", "")))
            else:
                self._local.submit(self._write_local, index, sample)
                self.on_threads += 1
        for k, entries in tasks.items():  # one message per process and batch
            procs[k].send((str(self.out.root), self.out.fmt, self._sums.checksum, entries))
            self.in_processes += len(entries)

    def _write_local(self, index: int, sample: dict) -> None:
        try:
            digest, nbytes = write_sample(self.out.root / file_name(index, self.out.fmt), sample, self.out.fmt,
                                          self._sums.checksum)
            self._done(index, digest, nbytes, int(sample["input_ids"].numel()))
        except BaseException as e:
            self._fail(e)

    # -------------------------------------------------------------- results
    @property
    def written(self) -> int:
        self._poll(0)  # (results that arrived since the last look)
        return self._sums.written

    @property
    def bytes_written(self) -> int:
        self._poll(0)
        return self._sums.bytes

    def _done(self, index: int, digest: str, nbytes: int, tokens: int) -> None:
        with self._cv:
            if index not in self._pending:  # not ours (cannot happen: the pool restarts after a failure)
                raise OutputError(f"writer process reported sample {index}, which this run did not send")
            self._sums.add(index, digest, nbytes, tokens)
            batch, _ = self._pending.pop(index)  # drops the sample: its rows may be reused
            proc, size = self._sizes.pop(index, (None, 0))
            if proc is not None:
                proc.load -= size
            self._batches[batch] -= 1
            if not self._batches[batch]:
                del self._batches[batch]
            self._cv.notify_all()

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, WriterProcessDied):
            # the pool is not reused even if this writer is never closed, nor while the dead
            # process, whose pipe already reads end-of-file, has not been reaped yet
            self.pool.broken = True
        with self._cv:
            if self.error is None:
                self.error = e
            self._cv.notify_all()

    def _timed_poll(self, counter: str) -> None:
        """One wait for results, its time added to ``counter`` (``wait_s`` or ``tail_s``), or to
        ``start_wait_s`` while a process has not started yet."""
        import time

        if not all(w.answered for w in self.pool.procs):
            counter = "start_wait_s"
        t = time.perf_counter()
        self._poll(self._wait_step())
        setattr(self, counter, getattr(self, counter) + time.perf_counter() - t)

    def _wait_step(self) -> float:
        """How long one wait for results may last: short while task bytes wait for room in a
        pipe, or local threads are writing (they report through the condition, not a pipe)."""
        if any(w.outbox for w in self.pool.procs) or len(self._pending) > len(self._sizes):
            return 0.005
        return 0.5

    def _poll(self, timeout: float) -> None:
        """Write what waits in the outboxes, take every result that has arrived (waiting up to
        ``timeout`` s for one), and turn a dead process into the run's error."""
        from multiprocessing.connection import wait

        procs = self.pool.procs
        for w in procs:
            w.flush()
        try:
            ready = wait([w.results for w in procs], timeout)
        except (OSError, ValueError) as e:  # the pool was torn down under us
            self._fail(e)
            return
        for conn in ready:
            w = next(w for w in procs if w.results is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._fail(_died(w.proc, w.proc.exitcode if not w.proc.is_alive() else "unknown (pipe closed)"))
                continue
            w.answered = True  # (a "pong" carries no results)
            try:
                for rec in msg[1]:
                    self._done(*rec)
                if msg[0] == "error":
                    self._fail(OutputError(f"writing sample {msg[2]} failed: {msg[3]}"))
            except BaseException as e:
                self._fail(e)
        if not ready and timeout:
            dead = self.pool.dead()
            if dead:
                self._fail(_died(dead[0], dead[0].exitcode))

    def close(self) -> None:
        """Wait for every queued sample (or the first failure), release the pool, re-raise."""
        try:
            while self.error is None and self._pending:
                self._timed_poll("tail_s")
            self._local.shutdown(wait=True)
            self._sums.close()
            if self.error is not None:  # tasks of this run may still be queued: start afresh next time
                shutdown_writer_pool(graceful=False)
            with self._cv:
                self._pending.clear()
                self._sizes.clear()
        finally:
            self.pool.lock.release()
        self.check()

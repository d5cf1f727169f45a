"""Input datasets: JSONL (one sample a line) or a speculators-preprocessed dataset directory
(``datasets.Dataset.save_to_disk`` layout: ``state.json`` + Arrow stream files), read lazily.

Each sample: ``{"input_ids": [int, ...], "loss_mask": [0/1, ...]}`` (loss_mask optional: all ones).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import DatasetError
from ..files.checksums import file_digest
from ..files.crc import crc32


@dataclass
class Sample:
    index: int
    input_ids: list[int]
    loss_mask: list[int] | None


_INT = {int}
_BITS = {0, 1}  # (True == 1 and False == 0 in a set too)
_TEXT_KEYS = {"text", "prompt", "messages", "conversations", "conversation", "content"}


def _validate(where: str, obj) -> tuple[list[int], list[int] | None]:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected an object with input_ids, got {type(obj).__name__}")
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not ids:
        text = sorted(set(obj) & _TEXT_KEYS) if "input_ids" not in obj else []
        hint = (
            (
                f" (this sample has {', '.join(text)}: the input must be tokenized already, e.g. by "
                "speculators' preprocessing, which writes input_ids and loss_mask)"
            )
            if text
            else ""
        )
        raise DatasetError(f"{where}: input_ids must be a non-empty list of token ids{hint}")
    for t in [] if set(map(type, ids)) == _INT and min(ids) >= 0 else ids:  # (fast path: all good)
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise DatasetError(f"{where}: input_ids holds {t!r}, not a non-negative integer")
    mask = obj.get("loss_mask")
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise DatasetError(
                f"{where}: loss_mask must be a list as long as input_ids "
                f"({len(ids)}), got {len(mask) if isinstance(mask, list) else type(mask).__name__}"
            )
        try:
            bits = set(mask) <= _BITS
        except TypeError:  # an unhashable value (a list, a dict) in the mask
            bits = False
        if not bits:
            raise DatasetError(f"{where}: loss_mask must hold 0/1 values")
        if set(map(type, mask)) != _INT:  # floats 0.0/1.0 and booleans become ints
            mask = [int(m) for m in mask]
    return ids, mask


def iter_jsonl(path: Path, lines=None) -> Iterator[Sample]:
    """The samples of a JSONL file; ``lines``: its raw lines, if the caller reads them (scan_input)."""
    if lines is None:
        with open(path, "rb") as f:
            yield from iter_jsonl(path, f)
        return
    index = 0  # decoded line by line, so a bad byte is named by its line
    for lineno, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a BOM that starts the file is dropped)
        except UnicodeDecodeError as e:
            raise DatasetError(
                f"{path}:{lineno}: not UTF-8 text ({e.reason} at column {e.start + 1}): "
                "the input must be UTF-8 JSON lines"
            ) from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
        ids, mask = _validate(f"{path}:{lineno}", obj)
        yield Sample(index, ids, mask)
        index += 1


def arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a ``Dataset.save_to_disk`` directory, in order, checked to be there."""
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / f["filename"] for f in state.get("_data_files", [])]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise DatasetError(
            f"{path / 'state.json'}: not a saved dataset's state file ({type(e).__name__}: {e})"
        ) from None
    if not files:
        raise DatasetError(f"{path}: state.json lists no data files")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DatasetError(f"{path}: state.json lists data files that are not there: {', '.join(missing)}")
    return files


def _pyarrow(path: Path):
    try:
        import pyarrow as pa
    except ImportError as e:
        raise DatasetError(f"{path}: reading a saved dataset needs pyarrow ({e})") from e
    return pa


def _record_batches(pa, f: Path):
    """A memory-mapped Arrow stream file's record batches (zero-copy); a damaged file is a DatasetError."""
    try:
        with pa.memory_map(str(f)) as src:
            yield from pa.ipc.open_stream(src)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{f}: not a readable Arrow stream ({type(e).__name__}: {e})") from None


def count_arrow_rows(path: Path) -> int:
    """Rows in a saved dataset, counted from its Arrow files' record batches (not from
    ``dataset_info.json``, whose split sizes are those of the dataset it was derived from, before any
    ``select`` / ``filter``)."""
    pa = _pyarrow(path)
    return sum(b.num_rows for f in arrow_files(path) for b in _record_batches(pa, f))


def iter_arrow_dir(path: Path, files: list[Path] | None = None) -> Iterator[Sample]:
    files = arrow_files(path) if files is None else files
    pa = _pyarrow(path)
    index = 0
    for f in files:
        for batch in _record_batches(pa, f):
            cols = batch.schema.names
            if "input_ids" not in cols:
                raise DatasetError(f"{f}: no input_ids column (columns: {cols})")
            ids_col = batch.column("input_ids").to_pylist()
            mask_col = batch.column("loss_mask").to_pylist() if "loss_mask" in cols else [None] * len(ids_col)
            for ids, mask in zip(ids_col, mask_col):
                ids, mask = _validate(f"{f} row {index}", {"input_ids": ids, "loss_mask": mask})
                yield Sample(index, ids, mask)
                index += 1


def open_dataset(path: str | Path) -> Iterator[Sample]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input {str(p)!r} does not exist")
    if p.is_dir():
        if (p / "state.json").exists():  # (its files are checked now, before an engine starts)
            files = arrow_files(p)
            _pyarrow(p)
            return iter_arrow_dir(p, files)
        if (p / "dataset_dict.json").exists():  # DatasetDict.save_to_disk: one sub-directory a split
            try:
                splits = json.loads((p / "dataset_dict.json").read_text()).get("splits") or []
            except (ValueError, AttributeError):
                splits = []
            hint = f"; pass one split's directory, e.g. {str(p / splits[0])!r}" if splits else ""
            raise DatasetError(
                f"{p}: a saved DatasetDict (splits: {', '.join(map(str, splits)) or 'none listed'}), "
                f"not one dataset{hint}"
            )
        raise DatasetError(f"{p}: a directory input must be a saved dataset (state.json + .arrow files)")
    return iter_jsonl(p)


# ---------------------------------------------------------------------------------------------
# The whole input, checked before an engine starts, and its fingerprint


@dataclass
class InputScan:
    """What ``scan_input`` found: the samples a run reads, those longer than the model takes, and
    the input's fingerprint (recorded in the output's run.json; a resume compares it)."""

    samples: int
    overlength: list[tuple[int, int]]  # (index, tokens) of samples over the length limit
    fingerprint: dict
    max_len: int | None = None
    whole: bool = True  # every sample of the input was read (not stopped at max_samples)
    recorded: bool = False  # taken from an earlier run's record of the same input (not parsed again)
    max_token: tuple[int, int] | None = None  # (index, id) of the first sample holding the largest id
    no_loss_mask: int = 0  # samples without a loss_mask (all ones)
    identity: dict | None = None  # the input's files' (device, inode, size, mtime) when it was read
    tokens: int | None = None  # of the samples a run reads, each cut to max_len (None: not counted)

    def record(self) -> dict:
        """What a later run over the same input (same fingerprint) can take instead of parsing it."""
        return {
            "fingerprint": self.fingerprint,
            "samples": self.samples,
            "whole": self.whole,
            "max_len": self.max_len,
            "overlength": [list(x) for x in self.overlength],
            "max_token": list(self.max_token) if self.max_token else None,
            "no_loss_mask": self.no_loss_mask,
            "tokens": self.tokens,
        }

    def check_vocab(self, vocab: int | None) -> None:
        """A token id at or above the model's vocabulary is named (its sample) before the engine."""
        if vocab and self.max_token and self.max_token[1] >= vocab:
            from ..errors import TokenIdError

            raise DatasetError(TokenIdError(0, self.max_token[1], vocab).message(f"sample {self.max_token[0]}"))


class _CrcLines:
    """A binary file's lines, with a CRC-32 of every byte read through it (``rest()`` reads the
    part after the last line asked for)."""

    def __init__(self, f):
        self.f, self.crc, self.bytes = f, 0, 0

    def __iter__(self):
        for line in self.f:
            self.crc = crc32(line, self.crc)
            self.bytes += len(line)
            yield line

    def rest(self) -> None:
        while chunk := self.f.read(8 << 20):
            self.crc = crc32(chunk, self.crc)
            self.bytes += len(chunk)


def input_fingerprint(path: str | Path) -> dict:
    """The fingerprint ``scan_input`` records, by hashing alone (no parsing: GB/s, not MB/s)."""
    p = Path(path)
    if p.is_dir():
        return _dir_fingerprint(p)
    return {"kind": "jsonl", "bytes": p.stat().st_size, "crc32": file_digest(p, "crc32")}


def _dir_fingerprint(p: Path) -> dict:
    state = json.loads((p / "state.json").read_text())
    return {
        "kind": "saved dataset",
        "dataset_fingerprint": state.get("_fingerprint"),
        "files": {f.name: {"bytes": f.stat().st_size, "crc32": file_digest(f, "crc32")} for f in arrow_files(p)},
    }


def input_files(path: str | Path) -> list[Path]:
    """The files an input reads: the JSONL file, or a saved dataset's state.json and Arrow files."""
    p = Path(path)
    return [p / "state.json", *arrow_files(p)] if p.is_dir() else [p]


def file_identity(files: list[Path]) -> dict:
    """Each file's (device, inode, size, modification time): what a rewrite, in place or by a
    rename over it, changes."""
    out = {}
    for f in files:
        try:
            st = f.stat()
        except FileNotFoundError:
            out[str(f)] = None
            continue
        out[str(f)] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    return out


class InputChangedError(DatasetError):
    """The input changed while a run read it (the run stops; no manifest is written)."""


def check_unchanged(path: str | Path, scan: InputScan, final: bool = False) -> None:
    """Raise InputChangedError if the input's files are not the ones ``scan`` read: their identity
    (each batch; a stat a file), and with ``final`` their contents hashed again (once, at the end:
    a rewrite that put the time back shows there)."""
    if scan.identity is None:
        return
    files = [Path(f) for f in scan.identity]
    changed = [f.name for f in files if file_identity([f])[str(f)] != scan.identity[str(f)]]
    if not changed and final and input_fingerprint(path) != scan.fingerprint:
        changed = ["its contents (hashed again at the end)"]
    if changed:
        raise InputChangedError(
            f"the input {str(path)!r} changed while this run read it ({', '.join(changed)}): stopped, and "
            "no manifest written. The files written so far hold the input as it was when the run "
            "started; for the input as it is now, run again into a new --output"
        )


def scan_input(
    path: str | Path, max_samples: int | None = None, max_len: int | None = None, known: dict | None = None
) -> InputScan:
    """Read the whole input once: every sample a run will read is validated (the first bad one is a
    DatasetError naming its line or row), counted and measured against ``max_len``; every byte of
    the input is hashed (CRC-32, streamed), also past ``max_samples``, so that the fingerprint is
    the file's whatever part of it a run reads. An input with no sample is a DatasetError.

    ``known``: an earlier scan's ``record()``. If the input's fingerprint is still the recorded one
    (hashed, not parsed) and that scan covered what this run reads, its findings are taken: a
    resume of a large input pays the hash (GB/s), not the parse (tens of MB/s)."""
    p = Path(path)
    identity = file_identity(input_files(p)) if p.exists() else None  # (before it is read: a change meanwhile shows)
    if (
        known
        and (p.is_file() or (p / "state.json").is_file())
        and known.get("max_len") == max_len
        and (known.get("whole") or (max_samples is not None and max_samples <= known.get("samples", -1)))
    ):
        fp = input_fingerprint(p)
        if fp == known.get("fingerprint") and "max_token" in known:
            n = known["samples"] if max_samples is None else min(known["samples"], max_samples)
            over = [(int(i), int(k)) for i, k in known.get("overlength", []) if i < n]
            top = tuple(known["max_token"]) if known.get("max_token") else None
            return InputScan(
                n,
                over,
                fp,
                max_len,
                whole=bool(known.get("whole")) and n == known["samples"],
                recorded=True,
                max_token=top if n == known["samples"] else None,  # (a part: the engine checks its ids)
                no_loss_mask=int(known.get("no_loss_mask") or 0),
                identity=identity,
                tokens=known.get("tokens") if n == known["samples"] else None,
            )
    samples = open_dataset(p)  # (checks what open_dataset checks: existence, a saved dataset's files)
    count, over, top, no_mask, tokens = 0, [], None, 0, 0

    def take(it: Iterator[Sample]) -> None:
        nonlocal count, top, no_mask, tokens
        for s in it:
            if max_samples is not None and count >= max_samples:
                break
            if max_len is not None and len(s.input_ids) > max_len:
                over.append((s.index, len(s.input_ids)))
            m = max(s.input_ids)
            if top is None or m > top[1]:
                top = (s.index, m)
            no_mask += s.loss_mask is None
            tokens += min(len(s.input_ids), max_len) if max_len is not None else len(s.input_ids)
            count += 1

    if p.is_dir():
        take(samples)
        fp = _dir_fingerprint(p)
    else:
        with open(p, "rb") as f:
            lines = _CrcLines(f)
            take(iter_jsonl(p, lines))
            lines.rest()
        fp = {"kind": "jsonl", "bytes": lines.bytes, "crc32": f"{lines.crc:08x}"}
    if count == 0 and max_samples != 0:
        raise DatasetError(
            f"input {str(p)!r} holds no samples"
            + (" (only blank lines)" if p.is_file() and p.stat().st_size else " (it is empty)")
        )
    return InputScan(
        count,
        over,
        fp,
        max_len,
        whole=max_samples is None or count < max_samples,
        max_token=top,
        no_loss_mask=no_mask,
        identity=identity,
        tokens=tokens,
    )


def describe_input_change(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints of an input, one phrase each (empty: the same)."""
    if old == new:
        return []
    if old.get("kind") != new.get("kind"):
        return [f"the input was a {old.get('kind')} and is now a {new.get('kind')}"]
    if new.get("kind") == "jsonl":
        if old.get("bytes") != new.get("bytes"):
            return [f"the input's size changed ({old.get('bytes'):,} -> {new.get('bytes'):,} bytes)"]
        return [f"the input's contents changed (same size, CRC-32 {old.get('crc32')} -> {new.get('crc32')})"]
    out = []
    if old.get("dataset_fingerprint") != new.get("dataset_fingerprint"):
        out.append(
            f"the saved dataset's fingerprint changed ({old.get('dataset_fingerprint')} -> "
            f"{new.get('dataset_fingerprint')})"
        )
    of, nf = old.get("files", {}), new.get("files", {})
    for n in sorted(set(of) | set(nf)):
        if of.get(n) != nf.get(n):
            out.append(f"its file {n} {'was added' if n not in of else 'was removed' if n not in nf else 'changed'}")
    return out

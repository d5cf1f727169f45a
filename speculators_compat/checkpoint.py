"""The model checkpoint on disk: checked before an engine starts, and fingerprinted.

``check_checkpoint(path)`` raises :class:`CheckpointError` naming the file when the directory
cannot be a loadable checkpoint: a file given where the directory is meant, no ``config.json``, a
shard that the safetensors index lists but that is not there, a safetensors file whose size is not
what its own header says (a truncated download or copy). Without it, vLLM's workers fail on such a
file and the driver only says ``WorkerProc initialization failed``.

``fingerprint_checkpoint(path, known)`` describes what the extracted states depend on, so that a
resumed extraction can refuse a model that changed under the same path: ``config.json`` and the
tokenizer files by SHA-256; each weight file by its size, modification time, the SHA-256 of its
safetensors header (names, dtypes, shapes, offsets), a SHA-256 of three 4 KiB samples of every
tensor (its start, middle and end: a merged LoRA or a re-initialised layer changes each tensor it
touches there) and a CRC-32 of the whole file. The whole-file CRC is what costs: it reads every
byte once (threads, one a file; docs/architecture.md gives the cost on a 600 GB checkpoint). A
resume reads it again only for the files whose size or modification time is not the recorded one
(``known``: the recorded fingerprint); for the others the per-tensor samples are read again. The
same holds across output directories: a file's whole-file CRC is kept in this user's cache
(``$SPECULATORS_COMPAT_CACHE/weight-crc32.json``, by real path), and taken again while the file's
size, modification time, inode and device are the ones it was read at, so a second dataset
extracted from the same model does not read the model in full again. No torch, no safetensors
package: the header format is read directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path

from .errors import CheckpointError
from .files.checksums import file_digest

logger = logging.getLogger(__name__)

TENSOR_SAMPLE_BYTES = 4 << 10  # read at a tensor's start, middle and end
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tiktoken.model",
    "added_tokens.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def is_local(model: str) -> bool:
    """Whether ``model`` names something on this machine (else a hub id, which is not checked)."""
    return os.path.exists(model) or model.startswith(("/", "./", "../", "~")) or model.count("/") != 1


def read_safetensors_header(path: Path) -> tuple[bytes, int]:
    """(raw JSON header, size of the tensor data it describes) of a safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{path}: its header claims {n:,} bytes but the file has {size:,} (truncated or not a safetensors file)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
    data = max(ends, default=0)
    if size != 8 + n + data:
        raise CheckpointError(
            f"{path}: {size:,} bytes, but its header describes {8 + n + data:,} "
            f"({'truncated' if size < 8 + n + data else 'trailing bytes'}: a download or "
            "copy that did not finish?)"
        )
    return raw, data


def _weight_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith(".")
    )


def check_checkpoint(model: str) -> None:
    """Raise CheckpointError if the local checkpoint ``model`` is visibly broken (module docstring).
    A hub id (not a local path) is left to the loader."""
    if not is_local(model):
        return
    p = Path(model).expanduser()
    if p.is_file():
        raise CheckpointError(
            f"model path {model!r} is a file: the model is given as its directory, the one "
            f"holding config.json and the weights (here perhaps {str(p.parent)!r})"
        )
    if not p.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"model directory {model!r} has no config.json")
    for name in INDEX_FILES:
        index = p / name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a readable weight index ({type(e).__name__}: {e})") from None
            missing = [s for s in shards if not (p / s).is_file()]
            if missing:
                raise CheckpointError(
                    f"{index} lists {len(missing)} weight file(s) that are not in {p}: "
                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
                )
    for f in _weight_files(p):
        if f.name.endswith(".safetensors"):
            read_safetensors_header(f)
        elif f.stat().st_size == 0:
            raise CheckpointError(f"{f}: empty weight file")


def model_limits(model: str) -> dict:
    """What config.json says bounds the input, for checks before an engine starts: ``vocab_size``,
    ``max_position_embeddings`` and whether ``rope_scaling`` stretches it (a text model's own, or
    its ``text_config``'s); {} for a hub id or a config without them."""
    cfg_file = Path(model).expanduser() / "config.json"
    if not is_local(model) or not cfg_file.is_file():
        return {}
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError:
        return {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    out = {}
    for k in ("vocab_size", "max_position_embeddings", "hidden_size"):
        v = cfg.get(k, text.get(k))
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[k] = v
    out["rope_scaling"] = bool(cfg.get("rope_scaling") or text.get("rope_scaling"))
    return out


def check_max_model_len(max_model_len: int | None, limits: dict, model: str) -> None:
    """A ``--max-model-len`` over the model's ``max_position_embeddings`` is refused before the
    engine (vLLM refuses it too, after the engine started). Left to vLLM: a model whose rope
    scaling stretches its context, and VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."""
    limit = limits.get("max_position_embeddings")
    if not max_model_len or not limit or limits.get("rope_scaling"):
        return
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return
    if int(max_model_len) > limit:
        raise CheckpointError(
            f"--max-model-len {int(max_model_len):,} is above the {limit:,} positions the model takes "
            f"(max_position_embeddings in {Path(model) / 'config.json'}): use --max-model-len {limit} or less"
        )


def _tensor_spans(raw: bytes, data_start: int) -> list[tuple[int, int]]:
    """(file offset, bytes) of every tensor in a safetensors file, in file order."""
    header = json.loads(raw)
    spans = [tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"]
    return [(data_start + int(a), int(b) - int(a)) for a, b in sorted(spans)]


def _sampled_sha256(path: Path, spans: list[tuple[int, int]]) -> str:
    """SHA-256 of every span's start, middle and end (TENSOR_SAMPLE_BYTES each; a small span whole)."""
    h, k = hashlib.sha256(), TENSOR_SAMPLE_BYTES
    with open(path, "rb") as f:
        for start, n in spans:
            at = [0] if n <= 3 * k else [0, (n - k) // 2, n - k]
            for off in at:
                f.seek(start + off)
                h.update(f.read(min(n, 3 * k) if n <= 3 * k else k))
    return h.hexdigest()


def _weight_entry(f: Path, known: dict | None) -> dict:
    st = f.stat()
    if f.name.endswith(".safetensors"):
        raw, _ = read_safetensors_header(f)
        entry = {"header_sha256": hashlib.sha256(raw).hexdigest()}
        spans = _tensor_spans(raw, 8 + len(raw))
    else:
        entry, spans = {}, [(0, st.st_size)]
    entry.update(bytes=st.st_size, mtime_ns=st.st_mtime_ns, tensors_sha256_sampled=_sampled_sha256(f, spans))
    same_file = known and known.get("bytes") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns
    if same_file and known.get("crc32"):
        entry["crc32"] = known["crc32"]  # (untouched since it was read in full: its samples were read again)
    else:
        entry["crc32"] = None  # (read in full by fingerprint_checkpoint, on a thread)
    return entry


def fingerprint_checkpoint(model: str, known: dict | None = None) -> dict:
    """What the states depend on (module docstring); a hub id is fingerprinted by its name only.
    ``known``: the fingerprint recorded by an earlier run (its whole-file CRCs are taken for the
    files whose size and modification time are unchanged)."""
    from concurrent.futures import ThreadPoolExecutor

    if not is_local(model) or not Path(model).is_dir():
        return {"hub_id": model}
    p = Path(model).expanduser()
    fp: dict = {
        "config.json": file_digest(p / "config.json", "sha256"),
        "tokenizer": {n: file_digest(p / n, "sha256") for n in TOKENIZER_FILES if (p / n).is_file()},
        "weights": {},
    }
    old = (known or {}).get("weights") or {}
    for f in _weight_files(p):
        fp["weights"][f.name] = _weight_entry(f, old.get(f.name))
    todo = [n for n, e in fp["weights"].items() if e["crc32"] is None]
    cache = _read_crc_cache() if todo else {}
    stamps = {n: _stamp(p / n) for n in todo}
    for n in todo:
        hit = cache.get(stamps[n][0])
        if hit and hit.get("stamp") == stamps[n][1]:
            fp["weights"][n]["crc32"] = hit["crc32"]
    todo = [n for n in todo if fp["weights"][n]["crc32"] is None]
    if todo:
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 16)) as pool:
            for n, crc in zip(todo, pool.map(lambda n: file_digest(p / n, "crc32"), todo)):
                fp["weights"][n]["crc32"] = crc
        _remember_crcs({stamps[n][0]: {"stamp": stamps[n][1], "crc32": fp["weights"][n]["crc32"]} for n in todo})
    return fp


def crc_cache_file() -> Path:
    """Where this user's whole-file CRCs of weight files are kept (module docstring)."""
    from . import envs

    return Path(os.path.expanduser(envs.get("SPECULATORS_COMPAT_CACHE"))) / "weight-crc32.json"


def _stamp(f: Path) -> tuple[str, list[int]]:
    """(real path, [size, modification time, inode, device]): a file's CRC stands while these do."""
    st = f.stat()
    return os.path.realpath(f), [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def _read_crc_cache() -> dict:
    path = crc_cache_file()
    try:
        got = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # unreadable or torn: the files are read in full instead
        logger.debug("ignoring the weight CRC cache %s: %s", path, e)
        return {}
    return got if isinstance(got, dict) else {}


def _remember_crcs(new: dict) -> None:
    """Add ``new`` to the cache file, replaced whole, its files that are gone left out (a process
    writing it meanwhile may lose its entries: they cost one more full read, never a wrong CRC)."""
    path = crc_cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {k: v for k, v in _read_crc_cache().items() if os.path.exists(k)} | new  # (gone files dropped)
        fd, tmp = tempfile.mkstemp(prefix=".weight-crc32-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:  # a read-only home: the next run reads the files in full again
        logger.debug("could not keep weight CRCs in %s: %s", path, e)


#: what the states depend on in a weight file's entry (its modification time is not: a copy
#: changes it; a changed time only makes the next resume read the file in full again)
CONTENT_KEYS = ("bytes", "header_sha256", "tensors_sha256_sampled", "crc32")


def _content(entry: dict | None) -> dict | None:
    return None if entry is None else {k: entry.get(k) for k in CONTENT_KEYS if k in entry}


def describe_model_change(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints of a model, one phrase each (empty: the same files;
    modification times are not compared, CONTENT_KEYS are)."""
    if "hub_id" in old or "hub_id" in new:
        return (
            []
            if old == new
            else [f"model {old.get('hub_id', 'a local directory')!r} -> {new.get('hub_id', 'a local directory')!r}"]
        )
    out = []
    if old.get("config.json") != new.get("config.json"):
        out.append("config.json changed")
    ot, nt = old.get("tokenizer", {}), new.get("tokenizer", {})
    for n in sorted(set(ot) | set(nt)):
        if ot.get(n) != nt.get(n):
            out.append(f"tokenizer file {n} {'added' if n not in ot else 'removed' if n not in nt else 'changed'}")
    ow, nw = old.get("weights", {}), new.get("weights", {})
    for n in sorted(set(ow) | set(nw)):
        a, b = _content(ow.get(n)), _content(nw.get(n))
        if a is not None and b is not None:  # (a record made before a key existed compares on the rest)
            a, b = ({k: v for k, v in e.items() if k in a and k in b} for e in (a, b))
        if a == b:
            continue
        if a is None or b is None:
            out.append(f"weight file {n} {'added' if a is None else 'removed'}")
        elif a.get("bytes") != b.get("bytes"):
            out.append(f"weight file {n} changed size ({a.get('bytes'):,} -> {b.get('bytes'):,} bytes)")
        elif a.get("header_sha256") != b.get("header_sha256"):
            out.append(f"weight file {n} holds other tensors (its header changed)")
        else:
            out.append(f"weight file {n} holds other values (same tensors and size, different contents)")
    return out

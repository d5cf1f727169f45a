"""The built-in output formats (registered in registry.py: names, where they go, which layer ids)
and the writing of data files: encodings and atomic writes.

    data_{i}.pt           {"input_ids": LongTensor[T], "hidden_states": [Tensor[T, H] per layer],
                           "loss_mask": LongTensor[T]}  (torch.save's bytes, built by ptfile;
                           speculators' trainer reads it)
    data_{i}.safetensors  the same as safetensors (hidden_states_0..L-1)
    shard_{k}.safetensors samples [k*N, (k+1)*N) (shards.py)
    hs_{i}.safetensors    ``--format speculators-hs`` (speculators >= 0.5, vLLM's own layout):
                          {"hidden_states": Tensor[T, L, H] (layers in the order asked),
                           "token_ids": LongTensor[T]}; the loss masks go to the dataset beside it
                          (trainer_dataset.py)

FP8 states (``--states-dtype fp8``, engine/fp8.py): speculators-hs adds "hidden_states_scales"
float32 [T, 1, 1] (hs-connectors' ``fp8`` layout, e4m3 "hidden_states"); safetensors adds it as
[T, 1]; a pt file holds the layers as a loader call that dequantizes them (fp8.PtStates).

Every file is written to a temp name (``.data_{i}.pt.partial``: not ``*pt``, so the trainer never
sees it) and renamed into place: a crash leaves either no file or the whole file.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from ..engine.fp8 import SCALES_KEY, PtStates
from . import crc, ptfile
from .checksums import DEFAULT_CHECKSUM, HashingFile, new_digest
from .registry import Format, get_format, register
from .stages import Clock, StageTimes

logger = logging.getLogger("speculators_compat.pipeline")

SHARD_FILE_RE = re.compile(r"^shard_(\d+)\.safetensors$")


def shard_name(k: int) -> str:
    return f"shard_{k}.safetensors"


def write_sample(
    path: Path,
    sample: dict[str, Any],
    fmt: str,
    checksum: str = DEFAULT_CHECKSUM,
    *,
    durable: bool = False,
    times: StageTimes | None = None,
) -> tuple[str | None, int]:
    """Write ``sample`` atomically to ``path``; returns (checksum hex or None, bytes). With
    ``durable`` the file's data reaches the disk (fdatasync) before it is renamed into place, so a
    file under its own name survives a power cut whole. ``times``: where each stage's seconds go
    (stages.py). The bytes are the format's (registry.py): its own writer where it has one (pt),
    else its serialised sample written with one call."""
    clock = Clock(times)
    f = get_format(fmt)
    if f.write is not None:
        return f.write(path, sample, checksum, durable, clock, times)
    return _write_bytes(path, f.serialise(sample), checksum, durable, clock, times)


def _write_bytes(path, data, checksum, durable, clock, times) -> tuple[str | None, int]:
    """A file of ``data`` (a format's serialised sample), hashed as it is."""
    clock.lap("encode")
    digest = new_digest(checksum, data).hexdigest()
    clock.lap("checksum")
    return digest, _counted(times, write_parts(path, [data], durable, clock))


def _write_pt(path, sample, checksum, durable, clock, times) -> tuple[str | None, int]:
    """A ``pt`` file: built by :mod:`ptfile` (torch.save's bytes, written from the states' own
    memory, faster: docs/benchmarks.md) unless it declines. Otherwise a sample whose states exceed
    ``SMALL_SAMPLE_BYTES`` streams torch.save into the file through a hash (no in-memory copy); a
    smaller one is serialised in memory and written with one call. All give the same bytes."""
    if SCALES_KEY in sample:  # FP8 states: torch.save writes the loader call
        sample = _pt_fp8_sample(_unowned_states(sample))
    else:
        parts = ptfile.encode(sample)  # torch.save's bytes, built directly; None: torch.save must write it
        if parts is not None:
            clock.lap("encode", minus=parts.crc_s)
            clock.count("checksum", parts.crc_s)
            if checksum == "crc32":  # from the records' own CRCs: the states are not read again
                digest = f"{crc.of_parts(parts, parts.known_crcs):08x}"
            else:
                h = new_digest(checksum)
                for p in parts:
                    h.update(p)
                digest = h.hexdigest()
            clock.lap("checksum")
            return digest, _counted(times, write_parts(path, parts, durable, clock))
        sample = _unowned_states(sample)
    if _payload_bytes(sample) <= SMALL_SAMPLE_BYTES:
        # a small sample: serialise in memory, write once, hash the same bytes (torch.save
        # streaming into a file makes ~64 small writes a file)
        return _write_bytes(path, _torch_bytes(sample), checksum, durable, clock, times)
    import torch

    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        hf = HashingFile(f, checksum)
        torch.save(sample, hf)  # (encoding, hashing and writing interleave: counted as the write)
        f.flush()
        clock.lap("write")
        if durable:
            os.fdatasync(f.fileno())
            clock.lap("sync")
    os.replace(tmp, path)
    clock.lap("rename")
    return hf.h.hexdigest(), _counted(times, hf.n)


def _counted(times: StageTimes | None, nbytes: int) -> int:
    if times is not None:
        times.files += 1
        times.bytes += nbytes
    return nbytes


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
        if (
            not isinstance(h, torch.Tensor)
            or h.device.type != "cpu"
            or not ptfile.owns_its_storage(h)
            or h.requires_grad
        ):  # (an alias would drop the flag, which torch.save keeps)
            return h
        nbytes = h.numel() * h.element_size()
        key = (h.data_ptr(), h.dtype, tuple(h.shape))
        if key not in aliases:
            raw = (ctypes.c_ubyte * nbytes).from_address(h.data_ptr())
            aliases[key] = torch.frombuffer(raw, dtype=torch.uint8).view(h.dtype).view(h.shape)
        return aliases[key]

    out = {**sample, "hidden_states": [alias(h) for h in sample["hidden_states"]]}
    if SCALES_KEY in sample:
        out[SCALES_KEY] = alias(sample[SCALES_KEY])
    return out


def _pt_fp8_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """FP8 states as a pt file holds them: layers and scales as one loader call (fp8.PtStates),
    dequantized at load to the model's dtype."""
    out = {k: v for k, v in sample.items() if k not in (SCALES_KEY, "dequantize_dtype")}
    dtype = sample.get("dequantize_dtype", "bfloat16")
    out["hidden_states"] = PtStates(sample["hidden_states"], sample[SCALES_KEY], dtype)
    return out


def _torch_bytes(sample: dict[str, Any]) -> memoryview:
    import torch

    buf = io.BytesIO()
    torch.save(sample, buf)
    return buf.getbuffer()  # no copy of the serialised bytes


SMALL_SAMPLE_BYTES = 1 << 20


def _payload_bytes(sample: dict[str, Any]) -> int:
    states = sample["hidden_states"]
    if isinstance(states, PtStates):
        states = [*states.args[0], states.args[1]]
    return sum(h.numel() * h.element_size() for h in states)


def _safetensors_bytes(sample: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    tensors = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
    tensors.update(distinct_states("hidden_states_{}", sample["hidden_states"]))
    if SCALES_KEY in sample:
        tensors[SCALES_KEY] = sample[SCALES_KEY].contiguous()
    return save(tensors)


def _hs_bytes(sample: dict[str, Any]) -> bytes:
    """vLLM's ``extract_hidden_states`` file: every layer's state stacked as [T, L, H], and the tokens."""
    import torch
    from safetensors.torch import save

    states = torch.stack([h.contiguous() for h in sample["hidden_states"]], dim=1)
    tensors = {"hidden_states": states, "token_ids": sample["input_ids"].to(torch.long).contiguous()}
    if SCALES_KEY in sample:  # hs-connectors' fp8 layout: [T, 1, 1], broadcast over [T, L, H]
        tensors[SCALES_KEY] = sample[SCALES_KEY].reshape(-1, 1, 1).contiguous()
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


def write_parts(path: Path | str, parts: list, durable: bool = False, clock: Clock | None = None) -> int:
    """Write the buffers ``parts`` one after another to ``path`` atomically (a temp name, then a
    rename: a crash leaves either no file or the whole file); returns the bytes written. With
    ``durable``, fdatasync before the rename: the file's write-back starts as soon as it is
    complete and overlaps whatever else runs, and a file under its own name is on the disk. Plain
    os calls and one writev per 512 buffers: the per-file cost matters at thousands of files a
    second. ``clock``: times the write, sync and rename (stages.py)."""
    clock = clock or Clock(None)
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.partial")
    views = [v.cast("B") for v in map(memoryview, parts) if v.nbytes]  # (sliced by bytes below)
    total, i = 0, 0
    fd = os.open(tmp, _O_NEW, 0o666)
    try:
        try:
            while i < len(views):
                n = os.writev(fd, views[i : i + _IOV_MAX])
                total += n
                while n:  # a short write: drop what went out, go on with the rest
                    if n >= views[i].nbytes:
                        n -= views[i].nbytes
                        i += 1
                    else:
                        views[i], n = views[i][n:], 0
            clock.lap("write")
            if durable:
                os.fdatasync(fd)
                clock.lap("sync")
        finally:
            os.close(fd)
        os.replace(tmp, path)
        clock.lap("rename")
    except BaseException:
        with contextlib.suppress(OSError):  # (the error that matters is the one being raised)
            os.unlink(tmp)
        raise
    return total


SHARD_TAG = "speculators-compat-shard/1"


def read_shard_range(path: Path) -> tuple[int, int, list[int]]:
    """(first, end, indices) from a shard's metadata; OSError/ValueError when it is not one of ours."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    info = json.loads(meta.get("speculators_compat", "{}"))
    if info.get("format") != SHARD_TAG:
        raise ValueError(f"{path.name} is not a speculators-compat shard (metadata {meta!r})")
    return int(info["first"]), int(info["end"]), [int(i) for i in info["indices"]]


def done_from_shards(root: Path, shard_size: int, total: int | None) -> set[int]:
    """Sample indices that complete shards in ``root`` cover (resume by shard: shards.py)."""
    done: set[int] = set()
    for p in sorted(root.iterdir()):
        m = SHARD_FILE_RE.match(p.name)
        if not m:
            continue
        k = int(m.group(1))
        try:
            first, end, _ = read_shard_range(p)
        except Exception as e:  # a foreign or damaged file: computed again and replaced
            logger.warning("shard %s is unreadable (%s): its samples are computed again", p.name, e)
            continue
        if first != k * shard_size or end > first + shard_size:
            raise ValueError(f"{p.name} covers samples [{first}, {end}), which is not shard {k} of size {shard_size}")
        if end == first + shard_size or (total is not None and end >= total):
            done.update(range(first, end))
        else:
            logger.info("shard %s stops at sample %d, short of its range: it is computed again", p.name, end)
    return done


def _read_pt(path: Path) -> dict[str, Any]:
    """A pt file's contents; FP8 states as stored (e4m3 layers and their scales), not dequantized."""
    import torch

    from ..engine.fp8 import Fp8States, raw_pt_states

    with raw_pt_states():
        d = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    states = d["hidden_states"]
    if isinstance(states, Fp8States):
        d["hidden_states"], d[SCALES_KEY] = list(states.layers), states.scales
    return d


def _read_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    d = load_file(str(path))
    n = sum(1 for k in d if k.startswith("hidden_states_") and k != SCALES_KEY)
    out = {k: v for k, v in d.items() if not k.startswith("hidden_states_") or k == SCALES_KEY}
    out["hidden_states"] = [d[f"hidden_states_{j}"] for j in range(n)]
    return out


def _read_hs(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    d = load_file(str(path))
    hs = d["hidden_states"]
    out = {"input_ids": d["token_ids"], "hidden_states": [hs[:, j] for j in range(hs.shape[1])]}
    if SCALES_KEY in d:
        out[SCALES_KEY] = d[SCALES_KEY].reshape(-1, 1)
    return out


PT = register(
    Format("pt", "data", "pt", _torch_bytes, _read_pt, sample_lengths=True, write=_write_pt),
)
SAFETENSORS = register(
    Format("safetensors", "data", "safetensors", _safetensors_bytes, _read_safetensors, shardable=True)
)
SPECULATORS_HS = register(
    Format(
        "speculators-hs", "hs", "safetensors", _hs_bytes, _read_hs, layer_ids="eagle3", states_subdir="hidden_states"
    )
)

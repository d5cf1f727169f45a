"""A fast writer of ``data_{i}.pt`` files, byte for byte what ``torch.save`` writes.

Why: on a small model the pipeline writes thousands of small files a second, and torch.save's
per-call cost (its pickler class, its zip writer, a Python file object) is most of the CPU a small
file takes. This module builds the same archive directly: the pickle comes
from Python's C pickler over light stand-ins for the tensors, the zip records from ``struct``, and
the tensors' bytes are never copied (``os.writev`` reads them where they lie).

It is only used where it is provably the same: :func:`encoder` checks itself once per process
against torch.save on probe samples (the archive's fixed records are learned from that probe, not
assumed), and :func:`encode` declines (returns None) for anything outside its narrow case, so the
caller then uses torch.save. Either way the file on disk is what torch.save would have written.

The archive torch.save writes (the "zip" serialization, torch >= 1.6), as observed:
  * stored (uncompressed) records, each local header padded with an ``FB`` extra field so that the
    record's data starts at a multiple of 64, flags 0x0808 (sizes in a data descriptor, UTF-8
    names), times zero; each record followed by a 16-byte data descriptor;
  * records ``archive/data.pkl``, then the fixed records torch writes before the storages (e.g.
    ``.format_version``, ``.storage_alignment``, ``byteorder``), the storages ``data/{key}`` in the
    order the pickle met them (or their keys' text order: learned from a probe of 14 storages),
    ``version``, and ``.data/serialization_id``;
  * a central directory, a zip64 end record and locator, and the classic end record;
  * the serialization id: 20 digits that depend only on the record names (taken from the probe),
    then 20 digits folding the records' CRC-32s.
"""

from __future__ import annotations

import ctypes
import io
import logging
import pickle
import struct
import threading
import time
from collections import OrderedDict
from typing import Any

from .. import envs
from .crc import crc32

logger = logging.getLogger("speculators_compat.pipeline")

# Every torch internal this module relies on (docs/inventory.md lists them; scripts/gen_inventory.py):
# (internal, what we use it for, checked versions, risk if it changes)
TORCH_INTERNALS = [
    (
        "torch.save's zip archive (records, 64-byte alignment, data descriptors, zip64 end, serialization id)",
        "build data_{i}.pt directly (files/ptfile.py)",
        "torch 2.8, 2.9.1, 2.10, 2.11, 2.13 (byte-identical on 200 random samples in each)",
        "low: checked against torch.save in every process before use; any difference: torch.save writes, with a warning",
    ),
    (
        "torch._utils._rebuild_tensor_v2, torch.storage._dtype_to_storage_type_map(), UntypedStorage._cdata",
        "the pickle torch.save makes for a plain CPU tensor; storage identity as torch.save keys it",
        "the same",
        "low: the same self-check; a missing name fails it (torch.save then writes)",
    ),
]

ALIGN = 64
PREFIX = "archive/"
MAX_BYTES = 1 << 31  # beyond this torch switches to zip64 fields: leave such files to torch.save
_M64 = (1 << 64) - 1

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<4sIII")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_END = struct.Struct("<4sHHHHIIH")


def _fold(seed: int, value: int) -> int:
    """The 64-bit hash-combine step the serialization id's second half is made of."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _M64) + (seed >> 2)) & _M64)) & _M64


class _Storage:
    """Stands in for a tensor's storage; the pickler replaces it with torch's persistent id."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple):
        self.pid = pid


class _Tensor:
    """Stands in for a tensor: pickles to the same call torch's own reduction makes."""

    __slots__ = ("args",)

    def __init__(self, args: tuple):
        self.args = args

    def __reduce__(self):
        from torch._utils import _rebuild_tensor_v2

        return _rebuild_tensor_v2, self.args


def owns_its_storage(t) -> bool:
    """``t`` is exactly its storage's bytes (contiguous, from offset 0, nothing more): the states
    the torch.save path saves through an alias (``files._unowned_states``)."""
    nbytes = t.numel() * t.element_size()
    return nbytes > 0 and t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if type(obj) is _Storage else None


class Encoder:
    """Builds torch.save's bytes for samples of the pipeline's shape. Use :func:`encoder`."""

    def __init__(self, before: list[tuple[str, bytes]], after: list[tuple[str, bytes]], keys_as_text: bool = False):
        import torch

        self.before, self.after = before, after  # the fixed records around the storages
        self.keys_as_text = keys_as_text  # storages in text order of their keys ("10" < "2"), else as met
        self._storage_types = {
            d: getattr(torch, n)
            for d, n in torch.storage._dtype_to_storage_type_map().items()
            if not n.startswith("Q") and hasattr(torch, n)
        }
        self._name_hash: dict[int, int | None] = {}  # storage count -> first half of the serialization id

    # -- the pickle ---------------------------------------------------------------------------
    # The files must be those the torch.save path writes, which saves ``files._unowned_states``
    # of the sample: a state that is exactly its storage's bytes is saved through one alias per
    # (address, dtype, shape), so equal rows given as two tensor objects (the process writer maps
    # a repeated layer twice) are saved once and referenced twice, as the thread writer's one
    # object is. Other tensors (views) are saved as torch.save saves them: per tensor object, each
    # storage once.
    def _stand_in(self, t, storages: dict, alias: tuple | None):
        """A :class:`_Tensor` for ``t``, or None where torch.save would pickle ``t`` differently.
        ``alias``: the key the torch.save path would alias ``t`` under, if any."""
        import torch

        if (
            t.layout is not torch.strided
            or t.device.type != "cpu"
            or t.requires_grad
            or t.is_conj()
            or t.is_neg()
            or t.dtype not in self._storage_types
            or t.__dict__
        ):
            return None
        st = t.untyped_storage()
        nbytes = st.nbytes()
        if not nbytes:  # torch.save lays out an empty record otherwise (never a pipeline sample)
            return None
        numel = nbytes // t.element_size()
        ident = alias or ("storage", st._cdata)
        got = storages.get(ident)
        if got is None:
            got = storages[ident] = (str(len(storages)), st.data_ptr(), nbytes)
        pid = ("storage", self._storage_types[t.dtype], got[0], "cpu", numel)
        return _Tensor((_Storage(pid), t.storage_offset(), tuple(t.shape), t.stride(), False, OrderedDict()))

    def _pickle(self, sample: dict) -> tuple[bytes, list[tuple[str, int, int]]] | None:
        import torch

        if type(sample) is not dict:
            return None
        storages: dict[tuple, tuple[str, int, int]] = {}  # identity -> (key, address, bytes), in key order
        made: dict = {}  # one stand-in per tensor object (or alias): a repeat pickles as a reference

        def conv(v):
            if type(v) is torch.Tensor:
                alias = ("alias", v.data_ptr(), v.dtype, tuple(v.shape)) if owns_its_storage(v) else None
                memo = alias or id(v)
                s = made.get(memo)
                if s is None:
                    s = self._stand_in(v, storages, alias)
                    if s is None:
                        raise _Decline
                    made[memo] = s
                return s
            if isinstance(v, torch.Tensor):  # a subclass: its own reduction
                raise _Decline
            if type(v) is list:
                return [conv(x) for x in v]
            if type(v) in (str, int, float, bool) or v is None:
                return v
            raise _Decline

        try:
            obj = {k: conv(v) for k, v in sample.items() if type(k) is str}
        except _Decline:
            return None
        if len(obj) != len(sample):
            return None
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        return buf.getvalue(), list(storages.values())

    # -- the archive --------------------------------------------------------------------------
    def encode(self, sample: dict) -> list | None:
        """The file's bytes as a list of buffers (header bytes and views of the tensors' memory,
        which must stay alive and unchanged until written), or None: then use torch.save."""
        got = self._pickle(sample)
        if got is None:
            return None
        pkl, storages = got
        records: list[tuple[str, Any]] = [("data.pkl", pkl), *self.before]
        if self.keys_as_text:
            storages.sort()
        for key, ptr, n in storages:
            data = memoryview((ctypes.c_ubyte * n).from_address(ptr)).cast("B")
            records.append((f"data/{key}", data))
        records.extend(self.after)
        n = len(storages)
        name_hash = self._name_hash[n] if n in self._name_hash else self._learn_name_hash(n)
        return None if name_hash is None else self._archive(records, name_hash)

    def _archive(self, records: list[tuple[str, Any]], name_hash: int) -> list | None:
        out = Parts()
        central: list[bytes] = []
        offset, crc_fold = 0, 0

        def add(name: str, data) -> None:
            nonlocal offset, crc_fold
            bname = (PREFIX + name).encode()
            start = offset + _LOCAL.size + len(bname) + 4
            pad = -start % ALIGN
            t = time.perf_counter()
            crc = crc32(data)
            out.crc_s += time.perf_counter() - t
            size = len(data)
            out.append(
                _LOCAL.pack(b"PK\x03\x04", 0, 0x0808, 0, 0, 0, 0, 0, 0, len(bname), 4 + pad)
                + bname
                + b"FB"
                + struct.pack("<H", pad)
                + b"Z" * pad
            )
            if size:
                out.known_crcs[len(out)] = crc  # (the file's own checksum reuses it: crc.of_parts)
                out.append(data)
            out.append(_DESCRIPTOR.pack(b"PK\x07\x08", crc, size, size))
            central.append(
                _CENTRAL.pack(b"PK\x01\x02", 0, 0, 0x0808, 0, 0, 0, crc, size, size, len(bname), 0, 0, 0, 0, 0, offset)
                + bname
            )
            offset = start + pad + size + _DESCRIPTOR.size
            crc_fold = _fold(crc_fold, crc)

        for name, data in records:
            add(name, data)
        add(".data/serialization_id", f"{name_hash:020d}{crc_fold:020d}".encode())
        if offset >= MAX_BYTES:
            return None
        cd = b"".join(central)
        n = len(central)
        tail = (
            _ZIP64_END.pack(b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), offset)
            + _ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, offset + len(cd), 1)
            + _END.pack(b"PK\x05\x06", 0, 0, n, n, len(cd), offset, 0)
        )
        out.append(cd + tail)
        return out

    def _learn_name_hash(self, n_storages: int) -> int | None:
        """The serialization id's first half depends on the record names only: read it from
        torch.save of a probe with the same number of storages (once per count; a count whose id
        cannot be read is left to torch.save, said once)."""
        import torch

        probe = {"hidden_states": [torch.full((1,), float(i)) for i in range(n_storages)]}
        sid = _records(_torch_save(probe)).get(".data/serialization_id", b"")
        got = int(sid[:20]) if len(sid) == 40 and sid.isdigit() else None
        if got is None:
            logger.warning(
                "data_{i}.pt files with %d tensors are written by torch.save (slower): its "
                "serialization id %r is not the 40 digits the direct encoder knows",
                n_storages,
                sid,
            )
        self._name_hash[n_storages] = got
        return got


class Parts(list):
    """The buffers of one file, in order; ``known_crcs`` maps the index of each record's data to
    that data's CRC-32, already computed for the zip record; ``crc_s`` the seconds those took."""

    def __init__(self, *args):
        super().__init__(*args)
        self.known_crcs: dict[int, int] = {}
        self.crc_s = 0.0


class _Decline(Exception):
    pass


def _torch_save(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _records(data: bytes) -> dict[str, bytes]:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename[len(PREFIX) :]: z.read(i) for i in z.infolist() if i.filename.startswith(PREFIX)}


def _probes() -> list[dict]:
    """Samples the self-check encodes both ways: owned states, a layer listed twice, a view (its
    storage keyed as torch.save keys it), and 14 storages (keys past "9")."""
    import torch

    g = torch.Generator().manual_seed(0)
    h = [torch.randn(7, 5, generator=g).to(torch.bfloat16) for _ in range(3)]
    return [
        {"input_ids": torch.arange(7), "hidden_states": h, "loss_mask": torch.ones(7, dtype=torch.long)},
        {
            "input_ids": torch.arange(6)[1:4],
            "hidden_states": [h[0][:3].clone(), h[0][:3].clone()[None][0]] * 2,
            "loss_mask": torch.zeros(3, dtype=torch.long),
        },
        {
            "input_ids": torch.arange(1),
            "hidden_states": [torch.randn(1, 13, generator=g) for _ in range(12)],
            "loss_mask": torch.ones(1, dtype=torch.long),
        },
    ]


def _build() -> tuple[Encoder | None, str]:
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    try:
        probes = _probes()
        recs = _records(_torch_save(probes[0]))
        names = list(recs)
        stores = [n for n in names if n.startswith("data/")]
        first, last = names.index(stores[0]), names.index(stores[-1])
        if names[0] != "data.pkl" or names[-1] != ".data/serialization_id":
            return None, f"torch {torch.__version__} writes records {names}, not the layout this encoder knows"
        many = [n for n in _records(_torch_save(probes[2])) if n.startswith("data/")]  # 14 storages
        enc = Encoder(
            [(n, recs[n]) for n in names[1:first]],
            [(n, recs[n]) for n in names[last + 1 : -1]],
            keys_as_text=many == sorted(many),
        )
        for i, p in enumerate(probes):
            parts = enc.encode(p)
            if parts is None:
                return None, f"probe {i} was declined"
            if b"".join(bytes(x) for x in parts) != _torch_save(p):
                return None, f"probe {i} differs from torch {torch.__version__}'s torch.save"
        return enc, "ok"
    except Exception as e:  # a torch whose archive differs in a way the probe trips over
        return None, f"{type(e).__name__}: {e}"


_ENCODER: list = []
_BUILD_LOCK = threading.Lock()


def encoder() -> Encoder | None:
    """This process's encoder, checked against torch.save once; None (logged once, with the
    reason) where it does not reproduce torch.save's bytes: the caller then uses torch.save."""
    if not _ENCODER:
        with _BUILD_LOCK:
            if not _ENCODER:
                enc, why = _build()
                if enc is None:
                    logger.warning(
                        "data_{i}.pt files are written by torch.save (slower), since the direct "
                        "encoder does not match it here: %s",
                        why,
                    )
                _ENCODER.append(enc)
    return _ENCODER[0]


MODE_ENV = "SPECULATORS_COMPAT_PT_WRITER"


def mode() -> str:
    """How ``data_{i}.pt`` files are made: ``direct`` (this encoder where it matches torch.save; the
    default) or ``torch`` (always torch.save). Read per file (envs.py)."""
    return envs.get(MODE_ENV)


def encode(sample: dict) -> list | None:
    """torch.save's bytes for ``sample`` as buffers, or None where torch.save must write it."""
    if mode() == "torch":
        return None
    enc = encoder()
    return enc.encode(sample) if enc is not None else None

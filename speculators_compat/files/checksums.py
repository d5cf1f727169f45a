"""Each output file's checksum: ``crc32`` (zlib's CRC-32, as zip and gzip use; the default),
``sha256`` or ``none``. A record names its algorithm by its key (``"crc32": 8 hex digits`` or
``"sha256": hex``). crc32 is the default because it costs a small part of sha256's CPU, which
the pipeline measurably gained from (docs/benchmarks.md); a ``data_{i}.pt`` file's crc32 is made
from the CRCs its zip records already hold (crc.of_parts), so the states are not read again.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from .crc import crc32

CHECKSUMS = ("crc32", "sha256", "none")


DEFAULT_CHECKSUM = "crc32"


class _Crc32:
    """crc.crc32 behind hashlib's update/hexdigest (it releases the GIL on large buffers too)."""

    def __init__(self, data=b""):
        self.v = crc32(data)

    def update(self, b) -> None:
        self.v = crc32(b, self.v)

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


class HashingFile(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, f, checksum: str = DEFAULT_CHECKSUM):
        self.f, self.h, self.n = f, new_digest(checksum), 0

    def writable(self):
        return True

    def write(self, b):
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)

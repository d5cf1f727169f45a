"""CRC-32 (zlib's, as zip and gzip use) of a whole file from the CRCs of its pieces.

A ``data_{i}.pt`` archive stores each tensor as a zip record with that record's CRC-32, and the
pipeline's ``checksums.jsonl`` holds the CRC-32 of the whole file. Hashing the file again would read
every byte of every hidden state a second time (a Kimi-K2.5-width sample of 2,048 tokens x 7,168 x
4 layers, bf16, is 117 MB; docs/benchmarks.md has the cost). Instead the file's CRC is
built from the record CRCs the archive already has, with the identity

    crc(A + B) = crc(A) * x^(8 len(B))  (mod P)   XOR   crc(B)

where P is CRC-32's polynomial and the product is of polynomials over GF(2): zlib's pre- and
post-inversion cancel between the two sides. That costs a few microseconds per piece whatever its
size (the power of x is cached per length), so only pieces of at least ``COMBINE_FROM`` bytes are
combined; smaller ones are hashed in place.

``crc32`` is the one CRC-32 function of the package: zlib-ng's (carry-less multiply, several times
zlib's speed; docs/benchmarks.md), or the standard library's where zlib-ng is not installed. Both
compute the same value and release the GIL on large buffers.
"""

from __future__ import annotations

from functools import lru_cache

try:
    from zlib_ng.zlib_ng import crc32

    IMPLEMENTATION = "zlib-ng"
except ImportError:  # (a platform without zlib-ng's wheel: the same CRC, slower)
    from zlib import crc32

    IMPLEMENTATION = "zlib"

POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed: bit 31 holds x^0, bit 0 holds x^31
ONE = 1 << 31  # the polynomial 1 in that order
COMBINE_FROM = 64 << 10  # below this, hashing the bytes is about as cheap as combining


def multiply(a: int, b: int) -> int:
    """a * b mod P, both in CRC-32's bit-reversed order."""
    product = 0
    bit = ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1  # b * x mod P
    return product


def _squares() -> list[int]:
    """x^(2^k) mod P for k = 0..63."""
    out = [ONE >> 1]  # x^1
    for _ in range(63):
        out.append(multiply(out[-1], out[-1]))
    return out


_X_2K = _squares()


@lru_cache(maxsize=4096)
def x_to_8n(n: int) -> int:
    """x^(8 n) mod P: the factor that moves a CRC past n bytes."""
    if n < 0:
        raise ValueError(f"a length is never negative: {n}")
    result, k, n8 = ONE, 0, n << 3
    while n8:
        if n8 & 1:
            result = multiply(_X_2K[k], result)
        n8 >>= 1
        k += 1
    return result


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of A followed by B, from CRC-32(A), CRC-32(B) and B's length in bytes."""
    return multiply(x_to_8n(len_b), crc_a) ^ crc_b


def of_parts(parts, known: dict[int, int] | None = None, crc: int = 0) -> int:
    """CRC-32 of the buffers ``parts`` one after another, continuing from ``crc``. ``known`` maps
    the index of a part to its own CRC-32 where that is already known: such a part of at least
    COMBINE_FROM bytes is not read again."""
    known = known or {}
    for i, p in enumerate(parts):
        c = known.get(i)
        n = memoryview(p).nbytes
        if c is not None and n >= COMBINE_FROM:
            crc = combine(crc, c, n)
        else:
            crc = crc32(p, crc)
    return crc

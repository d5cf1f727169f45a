"""speculators_compat.files.crc: the CRC-32 of a file from its pieces' CRCs must be zlib's CRC-32
of the whole file, for every split, and a piece whose CRC is given must not be read again."""

import os
import random
import zlib

import pytest

from speculators_compat.files import crc


def test_combine_equals_zlib_on_the_joined_bytes():
    rng = random.Random(0)
    for i in range(500):
        a = rng.randbytes(rng.choice([0, 1, 7, rng.randint(0, 5000)]))
        b = rng.randbytes(rng.choice([0, 1, 63, rng.randint(0, 5000)]))
        assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), i


def test_lengths_past_32_bits_of_bit_count():
    """Powers of x for lengths whose bit count (8 n) needs more than 32 bits: checked through the
    identity x^(8(m+n)) = x^(8m) x^(8n), since no such buffer fits in a test."""
    for m, n in [(1 << 29, 3), ((1 << 31) + 5, 1 << 30), (3 * (1 << 33), 12345)]:
        assert crc.x_to_8n(m + n) == crc.multiply(crc.x_to_8n(m), crc.x_to_8n(n))
    with pytest.raises(ValueError, match="negative"):
        crc.x_to_8n(-1)


def test_of_parts_with_known_crcs_equals_zlib_over_the_file():
    rng = random.Random(1)
    for i in range(50):
        parts = [
            rng.randbytes(rng.choice([0, 30, crc.COMBINE_FROM - 1, crc.COMBINE_FROM, 200_000]))
            for _ in range(rng.randint(1, 8))
        ]
        known = {j: zlib.crc32(p) for j, p in enumerate(parts) if rng.random() < 0.7}
        views = [memoryview(p) for p in parts]
        assert crc.of_parts(views, known) == zlib.crc32(b"".join(parts)), i
        assert crc.of_parts(parts) == zlib.crc32(b"".join(parts)), i


def test_a_big_piece_with_a_known_crc_is_not_read_again():
    """A wrong known CRC for a big piece changes the result (so the given CRC is what was used);
    for a small piece the bytes are read and the given CRC is ignored."""
    big, small = os.urandom(crc.COMBINE_FROM), os.urandom(100)
    true = zlib.crc32(b"x" + big + small)
    lie = {1: zlib.crc32(big) ^ 1, 2: zlib.crc32(small) ^ 1}
    assert crc.of_parts([b"x", big, small], lie) != true
    assert crc.of_parts([b"x", big, small], {2: lie[2]}) == true


def test_the_package_crc32_is_zlibs_crc32_whichever_library_computes_it():
    """crc.crc32 (zlib-ng's where installed) gives zlib's value on every length, alone and
    continued; with zlib-ng hidden the module falls back to the standard library's."""
    import subprocess
    import sys

    rng = random.Random(1)
    for n in [0, 1, 15, 16, 63, 64, 4095, 1 << 16, (1 << 20) + 7]:
        data = rng.randbytes(n)
        assert crc.crc32(data) == zlib.crc32(data), n
        assert crc.crc32(data[n // 3 :], crc.crc32(data[: n // 3])) == zlib.crc32(data), n
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, zlib; sys.modules['zlib_ng'] = None\n"
            "from speculators_compat.files import crc\n"
            "print(crc.IMPLEMENTATION, crc.crc32(b'speculators') == zlib.crc32(b'speculators'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.split() == ["zlib", "True"], r.stderr

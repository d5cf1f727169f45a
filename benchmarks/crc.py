#!/usr/bin/env python3
"""CRC-32 speed on one core: the package's (files/crc.py: zlib-ng's where installed) against the
standard library's zlib, over the same buffer, each the best of ``--reps``.

    python benchmarks/crc.py                # 256 MiB
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculators_compat.files import crc

    data = os.urandom(a.mib << 20)
    rates = {}
    for name, fn in (("zlib", zlib.crc32), (f"package ({crc.IMPLEMENTATION})", crc.crc32)):
        best = min(_timed(fn, data) for _ in range(a.reps))
        rates[name] = len(data) / best / 1e9
        print(f"{name}: {rates[name]:.2f} GB/s", flush=True)
    assert crc.crc32(data) == zlib.crc32(data)
    print(f"package/zlib: {list(rates.values())[1] / rates['zlib']:.2f}")
    return 0


def _timed(fn, data) -> float:
    t = time.perf_counter()
    fn(data)
    return time.perf_counter() - t


if __name__ == "__main__":
    raise SystemExit(main())

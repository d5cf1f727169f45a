"""What fingerprinting a model costs: a first run (whole-file CRC-32 + per-tensor samples), a resume
(per-tensor samples only) and, as the baseline in the same run, one plain read of the same files.

    python benchmarks/fingerprint.py [--gib 2] [--files 4] [--tensors 2048] [--dir DIR]

Writes a synthetic checkpoint of ``--files`` safetensors files (random bytes, ``--tensors`` tensors
in all) under DIR (default: a temporary folder), drops nothing from the page cache (so it measures
the hashing, not the disk: a cold 600 GB checkpoint is bound by its disk's read rate), and prints
seconds, GiB/s and the ratio to the plain read. No torch needed.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculators_compat.checkpoint import fingerprint_checkpoint  # noqa: E402


def write_checkpoint(d: Path, gib: float, files: int, tensors: int) -> int:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    per_file, per_tensor = tensors // files, int(gib * 2**30) // tensors
    block = os.urandom(per_tensor)
    for k in range(files):
        header = {
            f"t{k}.{i}": {"dtype": "U8", "shape": [per_tensor], "data_offsets": [i * per_tensor, (i + 1) * per_tensor]}
            for i in range(per_file)
        }
        raw = json.dumps(header).encode()
        with open(d / f"model-{k:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _ in range(per_file):
                f.write(block)
    return per_tensor * per_file * files


def plain_read(d: Path) -> None:
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=2048)
    ap.add_argument("--dir")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        d = Path(tmp) / "ckpt"
        n = write_checkpoint(d, a.gib, a.files, a.tensors)
        plain_read(d)  # (warm the page cache for every contender alike)
        base = timed(lambda: plain_read(d))
        fp = None

        def first():
            nonlocal fp
            fp = fingerprint_checkpoint(str(d))

        t_first = timed(first)
        t_resume = timed(lambda: fingerprint_checkpoint(str(d), known=fp))
        gib = n / 2**30
        print(f"{gib:.2f} GiB in {a.files} files, {a.tensors} tensors, {os.cpu_count()} CPUs")
        for name, t in (("plain read", base), ("first run", t_first), ("resume", t_resume)):
            print(f"  {name:<10} {t:8.3f} s  {gib / t:7.2f} GiB/s  ratio to the plain read {t / base:6.3f}")


if __name__ == "__main__":
    main()

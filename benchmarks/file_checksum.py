#!/usr/bin/env python3
"""CPU per data_{i}.pt file of the pipeline's write (files.write_sample: direct encoder, crc32
checksum, temp + rename), with the file's CRC-32 made from the records' own CRCs (crc.of_parts,
the default) against hashing every byte again (the baseline), alternating, same process.

    python benchmarks/file_checksum.py --rows 2048 --hidden 7168 --layers 4 --dir /dev/shm
Prints CPU ms per file (this thread: user + kernel) for each, the median over --reps rounds, and
the ratio on its last line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--files", type=int, default=5, help="files per round and way")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    from speculators_compat.files import crc
    from speculators_compat.files import formats as writer

    g = torch.Generator().manual_seed(0)
    sample = {
        "input_ids": torch.randint(0, 32000, (a.rows,), generator=g),
        "hidden_states": [torch.randn(a.rows, a.hidden, generator=g).bfloat16() for _ in range(a.layers)],
        "loss_mask": torch.ones(a.rows, dtype=torch.long),
    }
    root = Path(tempfile.mkdtemp(prefix="crc-bench-", dir=a.dir))
    combined = crc.of_parts

    def rehash(parts, known=None, start=0):  # the baseline: every byte through zlib.crc32 again
        return combined(parts, None, start)

    ways = {"records' CRCs combined": combined, "every byte hashed again": rehash}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    digests: dict[str, set] = {k: set() for k in ways}
    try:
        for r in range(a.reps + 1):  # round 0 warms up (the encoder's self-check, page cache)
            for name, fn in ways.items():
                crc.of_parts = fn
                t = time.thread_time()
                for i in range(a.files):
                    digests[name].add(writer.write_sample(root / f"data_{i}.pt", sample, "pt", "crc32")[0])
                if r:
                    cpu[name].append((time.thread_time() - t) / a.files * 1e3)
    finally:
        crc.of_parts = combined
        shutil.rmtree(root, ignore_errors=True)
    assert len(digests["records' CRCs combined"] | digests["every byte hashed again"]) == 1, digests
    mb = (a.rows * a.hidden * a.layers * 2) / 1e6
    print(f"sample: {a.rows} x {a.hidden} x {a.layers} layers bf16 = {mb:,.1f} MB; {a.files} files x {a.reps} rounds")
    print("| checksum made from | CPU ms per file (median) | spread |")
    print("|---|---|---|")
    for k, v in cpu.items():
        print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f} - {max(v):.2f} |")
    ratio = statistics.median(cpu["records' CRCs combined"]) / statistics.median(cpu["every byte hashed again"])
    print(f"ratio combined/rehash = {ratio:.3f}")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "rows": a.rows,
                    "hidden": a.hidden,
                    "layers": a.layers,
                    "mb": mb,
                    "dir": a.dir or tempfile.gettempdir(),
                    "cpu_ms": cpu,
                    "ratio": ratio,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

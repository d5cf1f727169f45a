#!/usr/bin/env python3
"""Write throughput of the pipeline's BackgroundWriter alone (no engine), per thread count.

Feeds ``--batches`` batches of ``--batch`` samples ([seq, hidden] bf16 per layer, the shapes the
engine returns) through BackgroundWriter and reports GiB/s of files written; beside it, plain
torch.save of the same samples on the same number of threads (no hashing, no checksum records):
what the writer's own bookkeeping costs. Alternating rounds, median and spread.
    python benchmarks/writer.py --threads 4,8,16 --seq 1024 --hidden 2048 --layers 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="2,4,8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculators_compat.pipeline.writer import BackgroundWriter, OutputDir

    g = torch.Generator().manual_seed(0)
    batches = [[(b * a.batch + i, {"input_ids": torch.arange(a.seq),
                                   "hidden_states": [torch.randn(a.seq, a.hidden, generator=g).bfloat16()
                                                     for _ in range(a.layers)],
                                   "loss_mask": torch.ones(a.seq, dtype=torch.long)})
                for i in range(a.batch)] for b in range(a.batches)]
    nbytes = a.batches * a.batch * a.layers * a.seq * a.hidden * 2
    root = Path(a.dir or tempfile.mkdtemp(prefix="sc-writer-bench-"))
    times: dict[str, list[float]] = {}

    def writer_run(n):
        out = root / f"w{n}"
        od = OutputDir(out, "pt")
        od.prepare({"bench": True})
        t = time.perf_counter()
        w = BackgroundWriter(od, queue_size=2, threads=n)
        for items in batches:
            w.put(items)
        w.close()
        dt = time.perf_counter() - t
        shutil.rmtree(out)
        return dt

    def plain_run(n):
        out = root / f"p{n}"
        out.mkdir()
        t = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            list(ex.map(lambda it: torch.save(it[1], out / f"data_{it[0]}.pt"), [it for b in batches for it in b]))
        dt = time.perf_counter() - t
        shutil.rmtree(out)
        return dt

    threads = [int(x) for x in a.threads.split(",")]
    for _ in range(a.reps):
        for n in threads:
            times.setdefault(f"writer[t{n}]", []).append(writer_run(n))
            times.setdefault(f"torch.save[t{n}]", []).append(plain_run(n))
    rows = {k: {"gib_s_median": nbytes / statistics.median(v) / 2**30, "gib_s_min": nbytes / max(v) / 2**30,
                "gib_s_max": nbytes / min(v) / 2**30} for k, v in times.items()}
    print(json.dumps({"bytes": nbytes, "cpus": os.cpu_count(), "dir": str(root)}))
    for k, r in rows.items():
        print(f"| {k} | {r['gib_s_median']:.2f} GiB/s | {r['gib_s_min']:.2f} - {r['gib_s_max']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "times": times, "bytes": nbytes}, indent=1))
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

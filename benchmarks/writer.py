#!/usr/bin/env python3
"""Write throughput of the pipeline's BackgroundWriter alone (no engine), per thread count.

Feeds ``--batches`` batches of ``--batch`` samples ([seq, hidden] bf16 per layer, the shapes the
engine returns, lent from a /dev/shm arena as the zero-copy hand-off returns them) through the
thread writer (BackgroundWriter) and the process writer (ProcessWriter), and reports GiB/s of
files written; beside them, plain torch.save of the same samples on the same number of threads (no
hashing, no checksum records). ``--spin`` adds a thread that loops on sched_yield, as the engine
driver's wait on vLLM's shared-memory queue does while the GPU works. Alternating rounds, median
and spread.
    python benchmarks/writer.py --threads 4,8,16 --seq 1024 --hidden 2048 --layers 4 --spin 0,1
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
    ap.add_argument("--spin", default="0", help="e.g. '0,1': without / with a sched_yield-spinning thread")
    ap.add_argument("--modes", default="thread,process,torch.save")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculators_compat.engine import arena as wk
    from speculators_compat.engine import handoff
    from speculators_compat.pipeline.output.outdir import OutputDir
    from speculators_compat.pipeline.writers.processes import ProcessWriter, shutdown_writer_pool
    from speculators_compat.pipeline.writers.threads import BackgroundWriter

    g = torch.Generator().manual_seed(0)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    arena = wk.Arena(os.path.join(shm, f"sc-writer-bench-{os.getpid()}-"), pin=False)
    row_bytes = a.hidden * 2
    arena.prepare(a.batches * a.batch * a.layers * (a.seq * row_bytes + wk.SHM_ALIGN))
    reader = handoff.ArenaReader(threads=1, lend=True)
    batches = []
    for b in range(a.batches):
        items = []
        for i in range(a.batch):
            layers = []
            for _ in range(a.layers):
                k, off = arena.alloc(a.seq * row_bytes)
                arena.view(k, off, a.seq, a.hidden, torch.bfloat16).copy_(torch.randn(a.seq, a.hidden, generator=g))
                layers.append(reader.assemble([(arena.path(k), off, a.seq)], a.hidden, torch.bfloat16))
            items.append(
                (
                    b * a.batch + i,
                    {
                        "input_ids": torch.arange(a.seq),
                        "hidden_states": layers,
                        "loss_mask": torch.ones(a.seq, dtype=torch.long),
                    },
                )
            )
        batches.append(items)
    nbytes = a.batches * a.batch * a.layers * a.seq * a.hidden * 2
    root = Path(a.dir or tempfile.mkdtemp(prefix="sc-writer-bench-"))
    times: dict[str, list[float]] = {}

    def writer_run(n, kind="thread"):
        out = root / f"w{n}"
        od = OutputDir(out, "pt")
        od.prepare({"bench": True})
        if kind == "process":  # start (or resize) the process pool outside the timing
            from speculators_compat.pipeline.writers.processes import writer_pool

            writer_pool(n)
        t = time.perf_counter()
        w = (
            ProcessWriter(od, reader.describe, queue_size=2, processes=n)
            if kind == "process"
            else BackgroundWriter(od, queue_size=2, threads=n)
        )
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

    import threading

    spinning = threading.Event()

    def spin():
        while True:
            spinning.wait()
            os.sched_yield()

    threading.Thread(target=spin, daemon=True).start()
    threads = [int(x) for x in a.threads.split(",")]
    modes = a.modes.split(",")
    spins = [int(x) for x in a.spin.split(",")]
    for _ in range(a.reps):
        for sp in spins:
            (spinning.set if sp else spinning.clear)()
            tag = "[spin]" if sp else ""
            for n in threads:
                for m in modes:
                    if m == "torch.save":
                        times.setdefault(f"torch.save[t{n}]{tag}", []).append(plain_run(n))
                    else:
                        times.setdefault(f"{m}[{n}]{tag}", []).append(writer_run(n, m))
    spinning.clear()
    shutdown_writer_pool()
    arena.close()
    rows = {
        k: {
            "gib_s_median": nbytes / statistics.median(v) / 2**30,
            "gib_s_min": nbytes / max(v) / 2**30,
            "gib_s_max": nbytes / min(v) / 2**30,
        }
        for k, v in times.items()
    }
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

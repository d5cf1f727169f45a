#!/usr/bin/env python3
"""The pipeline's writer against a plain sequential write of the same bytes, on one filesystem.

Feeds ``--batches`` batches of ``--batch`` samples ([seq, hidden] bf16 per layer, lent from a
/dev/shm arena as the engine's zero-copy hand-off lends them) through the pipeline's writers and
times each until every file is durable (each writer syncs each file before it records it; the
run ends with the output directory's final sync, as ``extract`` does). The baseline, measured in
the same run on the same filesystem: one thread writing the same states, one file a sample, each
file written with one call and fdatasync'd (no encoding, no checksum, no record). Alternating
rounds; medians. Per writer, the stage account (stages.py: encode, checksum, write, sync, rename,
record) in seconds per GB of writer time.

The last line is ``writer/plain: R``: the writer ``extract`` picks on a GPU host (the process
writer), over the plain write, on the first ``--dirs`` entry (default /dev/shm).

    python benchmarks/writer.py                                   # /dev/shm, 1 GiB
    python benchmarks/writer.py --dirs /dev/shm,/var/tmp --writers process,thread
    python benchmarks/writer.py --dirs /dev/shm,/var/tmp --floor 0.8         # as CI runs it
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
from pathlib import Path


def build_batches(a, torch, wk, handoff):
    """The samples, their rows in an arena as the engine lends them; returns (arena, reader, batches)."""
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
            sample = {
                "input_ids": torch.arange(a.seq),
                "hidden_states": layers,
                "loss_mask": torch.ones(a.seq, dtype=torch.long),
            }
            items.append((b * a.batch + i, sample))
        batches.append(items)
    return arena, reader, batches


def writer_run(kind, n, root, batches, reader):
    """One pipeline writer over every batch to a fresh folder; (seconds, stage report)."""
    from speculators_compat.pipeline.output.manifest import sync_filesystem
    from speculators_compat.pipeline.output.outdir import OutputDir
    from speculators_compat.pipeline.writers.processes import ProcessWriter
    from speculators_compat.pipeline.writers.threads import BackgroundWriter

    out = root / f"{kind}{n}"
    od = OutputDir(out, "pt")
    od.prepare({"bench": True})
    t = time.perf_counter()
    w = (
        ProcessWriter(od, reader.describe, queue_size=2, processes=n)
        if kind == "process"
        else BackgroundWriter(od, queue_size=2, threads=n)
    )
    for items in batches:
        w.put(items)
    w.close()
    sync_filesystem(out)  # (extract's final sync: nothing is left unwritten when it returns)
    dt = time.perf_counter() - t
    stages = w.stage_times().report()
    shutil.rmtree(out)
    return dt, stages


def write_plain(out: Path, files) -> float:
    """Seconds for one thread to write ``files`` ((name, [byte views]) each) into ``out``: one
    writev and fdatasync a file, no encoding, no checksum, no record: the filesystem at its
    plainest (the baseline here and in throughput.py)."""
    t = time.perf_counter()
    for name, views in files:
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.writev(fd, views)
            os.fdatasync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def file_cost_us(root: str, nbytes: int, n: int | None = None) -> dict:
    """CPU microseconds (this thread: user + kernel) per file to create, write ``nbytes`` and rename
    into ``root``, as the pipeline's writer does (throughput.py reports it per output directory;
    the files are deleted afterwards, untimed)."""
    from speculators_compat.files.formats import write_parts

    n = n or max(20, min(400, (256 << 20) // max(nbytes, 1)))  # at most ~256 MiB written
    d = tempfile.mkdtemp(prefix="fs-probe-", dir=root)
    data = os.urandom(nbytes)
    t = time.thread_time()
    for i in range(n):
        write_parts(os.path.join(d, f"data_{i}.pt"), [data])
    per_file = (time.thread_time() - t) / n * 1e6
    shutil.rmtree(d)
    return {"write_us": round(per_file, 1), "files": n}


def plain_write_s(root: str, sizes: list[int]) -> float:
    """Seconds for one thread to write files of ``sizes`` bytes of random data into ``root``
    (write_plain), throughput.py's baseline for the pipeline's disk rate; the files are deleted
    afterwards, untimed."""
    d = Path(tempfile.mkdtemp(prefix="plain-", dir=root))
    data = memoryview(os.urandom(max(sizes)))
    dt = write_plain(d, ((f"data_{i}.bin", [data[:n]]) for i, n in enumerate(sizes)))
    shutil.rmtree(d)
    return dt


def plain_run(root, batches):
    """The same states written by one thread, a file a sample (write_plain)."""
    out = root / "plain"
    out.mkdir()
    files = (
        (f"data_{index}.bin", [memoryview(h.numpy().view("uint8")).cast("B") for h in _raw(sample)])
        for items in batches
        for index, sample in items
    )
    dt = write_plain(out, files)
    shutil.rmtree(out)
    return dt


def _raw(sample):
    return [h.contiguous().view(-1).view(__import__("torch").uint8) for h in sample["hidden_states"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writers", default="process", help="pipeline writers to time: process,thread")
    ap.add_argument("--n", type=int, default=None, help="writer threads/processes (default: what extract picks here)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dirs", default="/dev/shm", help="filesystems to write to, comma separated")
    ap.add_argument("--json", default=None)
    ap.add_argument("--floor", type=float, default=None, help="exit 1 when writer/plain is below this (CI holds it)")
    a = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculators_compat.engine import arena as wk
    from speculators_compat.engine import handoff
    from speculators_compat.pipeline.writers.processes import (
        default_writer_processes,
        shutdown_writer_pool,
        writer_pool,
    )
    from speculators_compat.pipeline.writers.threads import default_writer_threads

    arena, reader, batches = build_batches(a, torch, wk, handoff)
    try:  # (the arena's GBs of /dev/shm released however the run ends)
        nbytes = sum(h.numel() * 2 for items in batches for _, s in items for h in s["hidden_states"])
        kinds = a.writers.split(",")
        counts = {k: a.n or (default_writer_processes() if k == "process" else default_writer_threads()) for k in kinds}
        if "process" in kinds:  # started (torch imported) before any timing
            writer_pool(counts["process"]).wait_ready()
        print(json.dumps({"bytes": nbytes, "cpus": os.cpu_count(), "writers": counts}), flush=True)
        results = {}
        for d in a.dirs.split(","):
            root = Path(tempfile.mkdtemp(prefix="sc-writer-bench-", dir=d))
            times: dict[str, list[float]] = {}
            stages = {}
            plain_run(root, batches)  # a round untimed: the filesystem's pages allocated once (on a VM
            for k in kinds:  # the first touch of guest memory costs several times a write)
                writer_run(k, counts[k], root, batches, reader)
            contenders = ["plain", *kinds]
            for rep in range(a.reps):  # (the order turns each round: no contender always follows the same one)
                for k in contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]:
                    if k == "plain":
                        times.setdefault(k, []).append(plain_run(root, batches))
                    else:
                        dt, stages[k] = writer_run(k, counts[k], root, batches, reader)
                        times.setdefault(k, []).append(dt)
            shutil.rmtree(root)
            gbs = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
            medians = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            results[d] = {"gb_s": gbs, "median_gb_s": medians, "stages": stages, "times": times}
            for k in kinds:
                per_gb = {s: v["s_per_gb"] for s, v in stages[k].items() if isinstance(v, dict)}
                print(
                    f"{d}: {k}[{counts[k]}] {gbs[k]:.2f} GB/s, plain {gbs['plain']:.2f} GB/s, ratio {gbs[k] / gbs['plain']:.2f} "
                    f"(medians {medians[k]:.2f} and {medians['plain']:.2f}); "
                    f"writer s/GB {json.dumps(per_gb)}",
                    flush=True,
                )
    finally:
        shutdown_writer_pool()
        arena.close()
    if a.json:
        Path(a.json).write_text(json.dumps({"bytes": nbytes, "results": results}, indent=1))
    first = results[a.dirs.split(",")[0]]["gb_s"]
    main_kind = "process" if "process" in kinds else kinds[0]
    ratio = first[main_kind] / first["plain"]
    print(f"writer/plain: {ratio:.2f}")
    return 1 if a.floor is not None and ratio < a.floor else 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""What the pipeline's input read-ahead thread costs the driver thread (no engine, no GPU).

The driver thread of an extraction prepares each batch (Python work), then waits for the workers
by spinning on a shared-memory queue: a loop around ``os.sched_yield()`` that lets go of the GIL
and must take it back each time it checks. Meanwhile the read-ahead thread parses the next batch
(JSON) and holds the GIL, and a thread that wants it back waits up to the switch interval (5 ms).

This simulates that driver: per batch, a preparation slice and ``--steps`` waits for replies
that are due every ``--step-ms`` (a clock deadline: nothing else needs the GIL to post them), and
measures how late each reply is noticed. Variants, alternated round by round: no reader (the
baseline), the pipeline's read-ahead (``_Prefetch`` over the JSONL reader), and the same reader
letting go of the GIL after each sample (``time.sleep(0)``: a candidate fix, not in the pipeline
because this benchmark showed nothing to fix; docs/gpu-results.md section 10). Prints per variant
the median over rounds of the total lateness and of the preparation time, and the ratios.
    python benchmarks/read_ahead.py --batch 32 --seq 1024 --batches 16 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="replies waited for per batch")
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculators_compat.pipeline.dataset import iter_jsonl
    from speculators_compat.pipeline.extract import _batches, _Prefetch

    def releasing(samples):
        for s in samples:
            yield s
            time.sleep(0)

    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp(prefix="sc-read-ahead-"))
    data = tmp / "in.jsonl"
    with open(data, "w") as f:
        for _ in range(a.batch * a.batches):
            f.write(json.dumps({"input_ids": [rng.randrange(32000) for _ in range(a.seq)]}) + "\n")

    def prepare(batch):  # like generate()'s preparation: token lists, request ids, the announcement
        seqs = [list(s.input_ids) for s in batch]
        return {f"req-{i}": len(x) for i, x in enumerate(seqs)}

    def drive() -> float:  # spin until each reply is due; return how late they were noticed (s)
        late = 0.0
        for _ in range(a.steps):
            due = time.perf_counter() + a.step_ms / 1e3
            while True:
                os.sched_yield()
                now = time.perf_counter()
                if now >= due:
                    late += now - due
                    break
        return late

    def one(variant: str) -> dict:
        if variant == "no reader":
            pre = list(_batches(iter_jsonl(data), a.batch))
            source = iter(pre)
            take = lambda: next(source, None)  # noqa: E731
            close = lambda: None  # noqa: E731
        else:
            samples = iter_jsonl(data)
            if variant == "read-ahead, letting go per sample":
                samples = releasing(samples)
            reader = _Prefetch(_batches(samples, a.batch))
            take, close = reader.next, reader.close
        late = prep = 0.0
        try:
            while (batch := take()) is not None:
                t = time.perf_counter()
                prepare(batch)
                prep += time.perf_counter() - t
                late += drive()
        finally:
            close()
        return {"late_s": late, "prep_s": prep}

    variants = ["no reader", "read-ahead", "read-ahead, letting go per sample"]
    res: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            res[v].append(one(v))
    base = statistics.median(r["late_s"] for r in res["no reader"])
    print(f"{a.batches} batches of {a.batch} x {a.seq} tokens, {a.steps} waits of {a.step_ms} ms a batch, "
          f"{a.rounds} rounds; switch interval {sys.getswitchinterval() * 1e3:.1f} ms")
    print("| driver thread | replies noticed late, s per run (median, min-max) | preparation, s per run |")
    print("|---|---|---|")
    summary = {}
    for v in variants:
        late = [r["late_s"] for r in res[v]]
        prep = [r["prep_s"] for r in res[v]]
        summary[v] = {"late_s_median": statistics.median(late), "late_s_min": min(late), "late_s_max": max(late),
                      "prep_s_median": statistics.median(prep)}
        print(f"| {v} | {statistics.median(late):.4f} ({min(late):.4f}-{max(late):.4f}) | {statistics.median(prep):.4f} |")
    before, after = (summary[v]["late_s_median"] for v in variants[1:])
    print(f"lateness: read-ahead / no reader = {before / max(base, 1e-9):.2f}, letting go / no reader = "
          f"{after / max(base, 1e-9):.2f}, letting go / read-ahead = {after / max(before, 1e-9):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "runs": res}, f, indent=1)
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())

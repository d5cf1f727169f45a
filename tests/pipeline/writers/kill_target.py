"""A writer run for the crash tests (tests/pipeline/writers/test_durability.py) to kill: ``python -m
tests.pipeline.writers.kill_target OUT KIND LOG`` writes samples through the pipeline's ``KIND`` writer
(thread, process or shards) until it is killed. Every process of it, the writer processes too
(spawn imports this module in each), appends to LOG one line per fdatasync and per rename, in the
order they happen (O_APPEND), so the test can tell whether each recorded file was synced before it
was renamed into place."""

from __future__ import annotations

import os
import sys

_LOG = os.environ.get("SC_KILL_TARGET_LOG")


def _spy() -> None:
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sync, replace = os.fdatasync, os.replace

    def fdatasync(f):
        sync(f)
        os.write(fd, f"sync {os.path.basename(os.readlink(f'/proc/self/fd/{int(f)}'))}\n".encode())

    def replace_(src, dst, *a, **k):
        replace(src, dst, *a, **k)
        os.write(fd, f"rename {os.path.basename(str(src))} {os.path.basename(str(dst))}\n".encode())

    os.fdatasync, os.replace = fdatasync, replace_


if _LOG:
    _spy()


def main(out: str, kind: str) -> None:
    import torch

    from speculators_compat.engine import arena as wk
    from speculators_compat.engine import handoff
    from speculators_compat.pipeline.output.outdir import OutputDir
    from speculators_compat.pipeline.writers.processes import ProcessWriter
    from speculators_compat.pipeline.writers.shards import ShardWriter
    from speculators_compat.pipeline.writers.threads import BackgroundWriter

    rows, hidden, batch = 256, 1024, 4
    arena = wk.Arena(os.path.join(out + "-arena", "a-"), pin=False)
    os.makedirs(out + "-arena", exist_ok=True)
    arena.prepare(8 * batch * 2 * rows * hidden * 2 + (1 << 20))
    reader = handoff.ArenaReader(threads=1, lend=True)
    fmt, shard = ("safetensors", 4) if kind == "shards" else ("pt", 1)
    od = OutputDir(out, fmt, shard_size=shard)
    od.prepare({"kill-target": True})
    if kind == "process":
        w = ProcessWriter(od, reader.describe, queue_size=2, processes=2)
    elif kind == "shards":
        w = ShardWriter(od, queue_size=2, threads=2)
    else:
        w = BackgroundWriter(od, queue_size=2, threads=2)
    g = torch.Generator().manual_seed(0)
    blocks = []
    for _ in range(8 * batch * 2):  # a ring of arena blocks, reused: the run goes on until killed
        k, off = arena.alloc(rows * hidden * 2)
        arena.view(k, off, rows, hidden, torch.bfloat16).copy_(torch.randn(rows, hidden, generator=g))
        blocks.append((arena.path(k), off))
    i = 0
    print("writing", flush=True)
    while True:
        items = []
        for _ in range(batch):
            layers = [
                reader.assemble([(p, off, rows)], hidden, torch.bfloat16)
                for p, off in blocks[(2 * i) % len(blocks) : (2 * i) % len(blocks) + 2]
            ]
            items.append(
                (
                    i,
                    {
                        "input_ids": torch.arange(rows) + i,
                        "hidden_states": layers,
                        "loss_mask": torch.ones(rows, dtype=torch.long),
                    },
                )
            )
            i += 1
        w.put(items, i) if kind == "shards" else w.put(items)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Helpers of the pipeline's unit tests: inputs, outputs and lent rows as the tests make them."""

import json

import pytest

from speculators_compat.pipeline.output.outdir import OutputDir


def lent_samples(tmp_path, n=6, rows=(3, 9, 1, 17, 5, 2), hidden=64, arena_bytes=1 << 20):
    """Samples whose hidden states are lent arena rows (a /dev/shm-like file and the engine's own
    reader), as the zero-copy hand-off returns them."""
    torch = pytest.importorskip("torch")
    from speculators_compat.engine import arena as wk
    from speculators_compat.engine import handoff

    arena = wk.Arena(str(tmp_path / "arena-"), pin=False)
    arena.prepare(arena_bytes)
    reader = handoff.ArenaReader(threads=1, lend=True)
    g = torch.Generator().manual_seed(11)
    items = []
    for i in range(n):
        r = rows[i % len(rows)]
        layers = []
        for _ in range(3):
            b, off = arena.alloc(r * hidden * 2)
            arena.view(b, off, r, hidden, torch.bfloat16).copy_(torch.randn(r, hidden, generator=g))
            layers.append(reader.assemble([(arena.path(b), off, r)], hidden, torch.bfloat16))
        items.append(
            (
                i,
                {
                    "input_ids": torch.arange(r) + i,
                    "hidden_states": layers,
                    "loss_mask": torch.ones(r, dtype=torch.long),
                },
            )
        )
    return arena, reader, items


def five_files(tmp_path):
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    out = OutputDir(tmp_path, "pt")
    out.prepare({"m": 1, "samples": 8})
    bw = w.BackgroundWriter(out, queue_size=1, threads=1)
    sample = {"input_ids": torch.arange(6), "hidden_states": [torch.randn(6, 16)], "loss_mask": torch.ones(6)}
    bw.put([(i, sample) for i in range(5)])
    bw.close()
    return out


def finished_file(root, name: str, data: bytes, index: int | None = None) -> None:
    """A data file as a writer leaves it: on disk, and recorded in checksums.jsonl (size, crc32, time)."""
    import zlib

    p = root / name
    p.write_bytes(data)
    rec = {
        "index": int(name.split("_")[1].split(".")[0]) if index is None else index,
        "file": name,
        "bytes": len(data),
        "tokens": 1,
        "crc32": f"{zlib.crc32(data):08x}",
        "mtime_ns": p.stat().st_mtime_ns,
    }
    with open(root / "checksums.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path

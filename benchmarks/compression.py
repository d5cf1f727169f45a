#!/usr/bin/env python3
"""Is lossless coding worth a flag? zstd on hidden states, measured before any of it is built.

States come from the drop-in generator (the real engine) on built-in random-weight models, in
bfloat16, one sample a prompt, stacked ``[tokens, layers, hidden]`` as files hold them. For each
model, three byte streams of the same states:

- ``bf16``: the raw bytes;
- ``bf16 planes``: the high bytes of every value, then the low bytes (sign and exponent apart from
  the mantissa's tail, which is near random);
- ``fp8``: e4m3 with one float32 scale per token (engine/fp8.py; the scales, 4 bytes a token, are
  counted uncompressed beside them).

Each is coded by zstd at levels 1 and 3 on one core, per sample (a file is coded alone), and the
table gives the size against the same dtype uncompressed, and encode / decode MB/s of input
(median of ``--reps``). Random weights are not trained ones: their states' statistics differ.

    pip install zstandard   # (not a dependency: only this benchmark uses it)
    python benchmarks/compression.py --models llama,llama-100m --prompts 8 --seq 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def states_of(model: str, prompts: int, seq: int) -> list:
    from speculators_compat import VllmHiddenStatesGenerator
    from speculators_compat.testing import models

    path = model if os.path.isdir(model) else str(models.build(model))
    import torch

    ids = models.random_prompts([seq] * prompts, seed=7)
    with VllmHiddenStatesGenerator(path, max_model_len=seq + 8, dtype="bfloat16", zero_copy=False) as gen:
        return [torch.stack(r["hidden_states"], dim=1).contiguous() for r in gen.generate(ids)]


def streams(x) -> dict[str, tuple[bytes, int]]:
    """name -> (bytes to code, bytes stored beside them uncompressed)."""
    import torch

    from speculators_compat.engine import fp8

    raw = x.view(torch.uint8).reshape(-1, 2)  # little-endian: [low, high] per value
    q, s = fp8.quantize_per_token(x)
    return {
        "bf16": (x.view(torch.uint8).numpy().tobytes(), 0),
        "bf16 planes": (raw[:, 1].numpy().tobytes() + raw[:, 0].numpy().tobytes(), 0),
        "fp8": (q.view(torch.uint8).numpy().tobytes(), s.numel() * 4),
    }


def measure(samples, level: int, reps: int) -> dict[str, dict]:
    import zstandard

    out = {}
    for name in ("bf16", "bf16 planes", "fp8"):
        parts = [streams(x)[name] for x in samples]
        raw = sum(len(b) + side for b, side in parts)
        enc, dec, coded = [], [], 0
        c, d = zstandard.ZstdCompressor(level=level, threads=0), zstandard.ZstdDecompressor()
        for _ in range(reps):
            t = time.perf_counter()
            blobs = [c.compress(b) for b, _ in parts]
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            for blob in blobs:
                d.decompress(blob)
            dec.append(time.perf_counter() - t)
            coded = sum(len(blob) + side for blob, (_, side) in zip(blobs, parts))
        n = sum(len(b) for b, _ in parts)
        out[name] = {
            "bytes": raw,
            "coded_bytes": coded,
            "ratio": round(coded / raw, 4),
            "encode_mb_s": round(n / 1e6 / statistics.median(enc), 1),
            "decode_mb_s": round(n / 1e6 / statistics.median(dec), 1),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,llama-100m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    torch.set_num_threads(1)  # (after the engine: the coding is on one core)
    results = {}
    for model in a.models.split(","):
        samples = states_of(model, a.prompts, a.seq)
        torch.set_num_threads(1)
        shape = list(samples[0].shape)
        for level in (1, 3):
            for name, r in measure(samples, level, a.reps).items():
                results[f"{model} zstd-{level} {name}"] = {"model": model, "shape": shape, "level": level, **r}
    print(f"{'model':<12} {'level':>5} {'stream':<12} {'size vs raw':>11} {'encode MB/s':>12} {'decode MB/s':>12}")
    for r_name, r in results.items():
        stream = r_name.split(" ", 2)[2]
        print(
            f"{r['model']:<12} {r['level']:>5} {stream:<12} {r['ratio']:>11.3f} {r['encode_mb_s']:>12,.0f} "
            f"{r['decode_mb_s']:>12,.0f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

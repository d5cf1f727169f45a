"""The flags of benchmarks/throughput.py (what each contender and variant runs)."""

from __future__ import annotations

import argparse


def parse(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="tiny model name (llama, llama-100m, llama-1b) or a path")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--batches", type=int, default=4, help="batches per timed run (the pipeline's writes overlap the next)"
    )
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--seq-mixed",
        default=None,
        help="LO,HI: each prompt's length drawn (seeded) from LO..HI "
        "instead of --seq, so engine steps split prompts as with a real dataset",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--layers", default=None, help="comma-separated layer ids (default: upstream's 4)")
    ap.add_argument(
        "--writer-threads", default=None, help="e.g. '8,16': pipeline writer threads (default: the pipeline's)"
    )
    ap.add_argument("--writer-modes", default="auto", help="e.g. 'thread,process': the pipeline's writer")
    ap.add_argument(
        "--pt-writers",
        default=None,
        help="e.g. 'direct,torch': how data_{i}.pt files are made "
        "(SPECULATORS_COMPAT_PT_WRITER: the direct encoder, the default, or torch.save)",
    )
    ap.add_argument(
        "--checksums",
        default="crc32",
        help="e.g. 'crc32,sha256': the pipeline's file checksum (crc32 is the pipeline's default)",
    )
    ap.add_argument("--formats", default="pt", help="e.g. 'pt,safetensors': the pipeline's output format")
    ap.add_argument(
        "--shard-sizes",
        default="1",
        help="e.g. '1,64': samples per file (> 1: safetensors shards, timed with --formats safetensors only)",
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where the pipeline writes (default: a temp dir; e.g. /dev/shm to take the disk out of the measurement)",
    )
    ap.add_argument(
        "--out-dirs",
        default=None,
        help="e.g. '/tmp,/dev/shm': time the pipeline writing to each, "
        "alternated in one run (overrides --out-dir for the pipeline's output)",
    )
    ap.add_argument(
        "--states-dtypes",
        default="auto",
        help="e.g. 'auto,fp8': the generate and pipeline contenders on an engine of each states dtype "
        "(on a GPU all engines stay alive: leave room for each with --gpu-memory-utilization)",
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-native", action="store_true", help="leave out vLLM's own extractor")
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args(argv)
    if a.seq_mixed and not a.no_hf:
        ap.error("--seq-mixed needs --no-hf (the HF contender runs equal-length micro-batches)")
    return a

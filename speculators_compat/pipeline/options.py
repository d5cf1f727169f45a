"""Command-line options of ``extract`` and ``plan`` (shared)."""

from __future__ import annotations

import argparse

from .checksums import CHECKSUMS


def _layer_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--layer-ids must be comma-separated integers, not {s!r}") from e


def _int_at_least(least: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = least - 1
        if v < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, not {s!r}")
        return v

    parse.__name__ = f"integer >= {least}"  # (argparse names the type in some messages)
    return parse


_positive_int = _int_at_least(1)


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = -1.0
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], not {s!r}")
    return v


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (or hub id, if reachable)")
    p.add_argument(
        "--layer-ids",
        type=_layer_ids,
        default=None,
        help="comma-separated decoder layer ids (default: upstream's [2, n//2, n-3, n-1])",
    )
    p.add_argument(
        "--layer-id-convention",
        choices=("upstream", "eagle3"),
        default=None,
        help="upstream (speculators 0.3/0.4: id L = decoder layer L's output) or eagle3 (vLLM's and "
        "speculators >= 0.5's: id k = the output of k layers); default: eagle3 with --format "
        "speculators-hs, else upstream",
    )
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    p.add_argument("--max-model-len", type=_int_at_least(2), default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="needed for Kimi-K2.5 (its config/tokenizer classes ship inside the checkpoint)",
    )
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    p.add_argument("--max-num-seqs", type=_positive_int, default=None)
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.8)
    p.add_argument("--enable-expert-parallel", action="store_true")


def add_extract_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument(
        "--input",
        required=True,
        help="JSONL ({'input_ids': [...], 'loss_mask': [...]}) or a speculators-preprocessed dataset directory",
    )
    p.add_argument("--output", required=True, help="output directory (data_{i}.pt + manifest.json)")
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--max-samples", type=_int_at_least(0), default=None)
    p.add_argument(
        "--format",
        choices=("pt", "safetensors", "speculators-hs"),
        default="pt",
        help="pt: speculators 0.3/0.4's data_{i}.pt, one file a sample (their trainers read these; "
        "with sample_lengths.json); safetensors: data_{i}.safetensors, or shards with "
        "--shard-size; speculators-hs: speculators >= 0.5's layout, OUTPUT/hidden_states/"
        "hs_{i}.safetensors + the input_ids/loss_mask dataset in OUTPUT (its --data-path)",
    )
    p.add_argument(
        "--shard-size",
        type=_positive_int,
        default=1,
        help="with --format safetensors: samples per file (shard_{k}.safetensors holds samples "
        "[k*N, (k+1)*N); read with speculators_compat.pipeline.shards.load_shard); "
        "1: one file a sample. Shards are written on --writer-threads threads (729 MiB/s with 8 "
        "on an H200 host, against ~4 GB/s for data_{i}.pt): for small states only",
    )
    p.add_argument("--async-scheduling", choices=("disable", "keep"), default=None)
    p.add_argument("--on-overlength", choices=("truncate", "error", "skip"), default="truncate")
    p.add_argument("--queue-size", type=_positive_int, default=2, help="batches waiting to be written (bounds memory)")
    p.add_argument(
        "--writer",
        choices=("auto", "thread", "process"),
        default="auto",
        help="write files on threads or in processes (auto: processes on a GPU host)",
    )
    p.add_argument(
        "--writer-threads",
        type=_positive_int,
        default=None,
        help="files written in parallel: threads (default half the CPUs, 2..8) or "
        "processes (default on a GPU host: CPUs - 2 - tensor-parallel size, 2..16; "
        "elsewhere half the CPUs, 2..16)",
    )
    p.add_argument(
        "--checksum",
        choices=CHECKSUMS,
        default=None,
        help="each file's checksum in checksums.jsonl and manifest.json (default: what an earlier "
        "run into --output used, else crc32: zlib's CRC-32, ~3x less CPU than sha256)",
    )
    p.add_argument(
        "--verify-existing",
        action="store_true",
        help="on resume, checksum every file already written (default: those an interrupted run "
        "wrote in its last minute, and any whose size or modification time changed)",
    )
    p.add_argument(
        "--no-self-check",
        action="store_true",
        help="skip the per-request check that the token vLLM sampled is the one its captured "
        "final-layer state implies (default: on; docs/architecture.md#the-self-check)",
    )
    scale = p.add_argument_group("scaling out (docs/scaling-out.md)")
    scale.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        help="the dataset is extracted in this many parts (processes or hosts) into one --output "
        "(a shared filesystem); default: torchrun's WORLD_SIZE, else Slurm's SLURM_NTASKS, else 1",
    )
    scale.add_argument(
        "--rank",
        type=_int_at_least(0),
        default=None,
        help="which part this process extracts, 0..world-size-1 (default: RANK, else SLURM_PROCID)",
    )
    scale.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=None,
        help="engines on this host, each on its own --tensor-parallel-size GPUs (or CPU cores), as "
        "that many parts of the run; with --ray: the number of shards (default: the cluster's GPUs "
        "/ tensor-parallel size)",
    )
    scale.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the parts as Ray actors (pip install speculators-compat[ray]); ADDRESS: the "
        "cluster (default: the one RAY_ADDRESS names or a local one)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan (reads config.json only) and exit")
    p.add_argument("--no-progress", action="store_true")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--input", default=None, help="dataset, to size the output (optional)")
    p.add_argument("--num-samples", type=_positive_int, default=None)
    p.add_argument("--avg-tokens", type=float, default=None)
    p.add_argument("--batch-size", type=_positive_int, default=8, help="as for extract: sizes the host hand-off arena")
    p.add_argument("--queue-size", type=_positive_int, default=2, help="as for extract: sizes the host hand-off arena")
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="per-GPU memory (default: detect, else 141 GiB H200)"
    )
    p.add_argument("--world-size", type=_positive_int, default=None, help="as for extract: each part's share")
    p.add_argument("--data-parallel-size", type=_positive_int, default=None, help="as for extract: parts per host")
    p.add_argument("--json", action="store_true")

"""The options of ``extract`` and ``plan``: the command-line flags (shared by both), and
:class:`ExtractOptions`, the one record of an extraction's settings that the CLI, the launchers
and Python callers build and ``run_extract`` reads. Adding an extract flag: its ``add_argument``
here and its field in ExtractOptions (``from_args`` takes every field by name). The engine's own
settings are declared once, in EngineOptions (engine/settings.py), and reach every command from
there."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ..engine import settings
from ..engine.config import EngineOptions, check_states_dtype
from ..files.checksums import CHECKSUMS, check_checksum
from ..files.registry import format_names, get_format

WRITER_MODES = ("auto", "thread", "process")
#: ExtractOptions fields whose flag says the opposite, or is named otherwise
_FROM_FLAG = {"fmt": ("format", False), "progress": ("no_progress", True), "self_check": ("no_self_check", True)}


@dataclass
class ExtractOptions:
    """What an extraction does, beside the model, input and output it reads and writes."""

    layer_ids: list[int] | None = None
    layer_id_convention: str | None = None
    batch_size: int = 8
    max_samples: int | None = None
    fmt: str = "pt"
    on_overlength: str = "truncate"
    queue_size: int = 2
    progress: bool | Callable = True  # a bool (a tqdm bar or none), or ``(total) -> bar``
    writer: str = "auto"
    writer_threads: int | None = None
    checksum: str | None = None
    shard_size: int = 1
    verify_existing: bool = False
    self_check: bool = True
    engine: dict[str, Any] = field(default_factory=dict)  # the generator's keyword arguments

    @classmethod
    def build(cls, **kw) -> ExtractOptions:
        """From keyword arguments (``run_extract``'s Python callers): the fields by name, and every
        other one an engine setting."""
        names = {f.name for f in fields(cls)} - {"engine"}
        engine = dict(kw.pop("engine", None) or {})
        engine.update({k: v for k, v in kw.items() if k not in names})
        return cls(**{k: v for k, v in kw.items() if k in names}, engine=engine)

    @classmethod
    def given(cls, options: ExtractOptions | None, kw: dict) -> ExtractOptions:
        """``options``, or built from a caller's keyword arguments (not both)."""
        if options is None:
            return cls.build(**kw)
        if kw:
            raise TypeError(f"give the settings in ExtractOptions or as keywords, not both ({', '.join(kw)})")
        return options

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ExtractOptions:
        kw = {}
        for f in fields(cls):
            flag, negated = _FROM_FLAG.get(f.name, (f.name, False))
            if hasattr(args, flag):
                kw[f.name] = not getattr(args, flag) if negated else getattr(args, flag)
        kw["engine"] = settings.from_args(args, EngineOptions)
        return cls(**kw)

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.get("tensor_parallel_size") or 1

    @property
    def devices_per_engine(self) -> int:
        """GPUs (or CPU core groups) one engine's workers take: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * (self.engine.get("pipeline_parallel_size") or 1)

    @property
    def states_dtype(self) -> str:
        return self.engine.get("states_dtype") or "auto"

    def check(self, input_path: str, output: str) -> None:
        """Every setting a run can refuse without touching anything (ValueError naming it)."""
        from .writers.shards import check_shard_size

        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, not {self.batch_size}")
        m = self.max_samples
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"--max-samples must be an integer >= 0, not {m!r}")
        if self.writer not in WRITER_MODES:
            raise ValueError(f"writer must be one of {WRITER_MODES}, not {self.writer!r}")
        if self.on_overlength not in ("truncate", "error", "skip"):
            raise ValueError(f"on_overlength must be truncate, error or skip, not {self.on_overlength!r}")
        check_checksum(self.checksum)
        check_shard_size(self.shard_size, self.fmt, self.writer)
        check_states_dtype(self.states_dtype)
        if self.states_dtype == "fp8" and self.shard_size > 1:
            raise ValueError(
                "--states-dtype fp8 is written one file a sample (--format speculators-hs, pt or "
                "safetensors), not in shards: leave out --shard-size"
            )
        if not get_format(self.fmt).states_subdir:  # (no trainer dataset beside its files)
            return
        if self.on_overlength == "skip":
            raise ValueError(
                f"--format {self.fmt}: --on-overlength skip would leave a dataset row with no "
                "states file (its trainer would try to generate it): use truncate or error"
            )
        if os.path.realpath(output) == os.path.realpath(input_path):
            raise ValueError(
                f"--format {self.fmt}: --output {output} is the input dataset; extract writes its "
                "own input_ids/loss_mask dataset into --output (beside the states), which would "
                "replace the input's files: give another directory"
            )
        from .output.trainer_dataset import require_datasets

        require_datasets()


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
    settings.add_engine_args(p, EngineOptions)  # (every engine setting, as declared: engine/settings.py)


def add_extract_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    _add_data_args(p)
    _add_writing_args(p)
    _add_scale_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan (reads config.json only) and exit")
    p.add_argument("--no-progress", action="store_true")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """What is read and what is written, and how."""
    p.add_argument(
        "--input",
        required=True,
        help="JSONL ({'input_ids': [...], 'loss_mask': [...]}) or a speculators-preprocessed dataset directory",
    )
    p.add_argument("--output", required=True, help="output directory (data_{i}.pt + manifest.json)")
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--max-samples", type=_int_at_least(0), default=None)
    _add_format_arg(p)
    p.add_argument(
        "--shard-size",
        type=_positive_int,
        default=1,
        help="with --format safetensors: samples per file (shard_{k}.safetensors holds samples "
        "[k*N, (k+1)*N); read with speculators_compat.pipeline.writers.shards.load_shard); "
        "1: one file a sample. Shards are written on --writer-threads threads, far slower than "
        "data_{i}.pt files (docs/benchmarks.md): for small states only",
    )
    p.add_argument("--on-overlength", choices=("truncate", "error", "skip"), default="truncate")


def _add_writing_args(p: argparse.ArgumentParser) -> None:
    """The writers, the records, the checks."""
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
        "run into --output used, else crc32: the CRC-32 of zip and gzip, far less CPU than sha256)",
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


def _add_scale_args(p: argparse.ArgumentParser) -> None:
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


def _add_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        choices=format_names(),
        default="pt",
        help="pt: speculators 0.3/0.4's data_{i}.pt, one file a sample (their trainers read these; "
        "with sample_lengths.json); safetensors: data_{i}.safetensors, or shards with "
        "--shard-size; speculators-hs: speculators >= 0.5's layout, OUTPUT/hidden_states/"
        "hs_{i}.safetensors + the input_ids/loss_mask dataset in OUTPUT (its --data-path)",
    )


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    _add_format_arg(p)  # (its layer-id convention and default ids)
    p.add_argument("--input", default=None, help="dataset, to size the output (optional)")
    p.add_argument("--num-samples", type=_positive_int, default=None)
    p.add_argument("--avg-tokens", type=float, default=None)
    p.add_argument("--batch-size", type=_positive_int, default=8, help="as for extract: sizes the host hand-off arena")
    p.add_argument("--queue-size", type=_positive_int, default=2, help="as for extract: sizes the host hand-off arena")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="per-GPU memory (default: detect, else 141 GiB)")
    p.add_argument("--world-size", type=_positive_int, default=None, help="as for extract: each part's share")
    p.add_argument("--data-parallel-size", type=_positive_int, default=None, help="as for extract: parts per host")
    p.add_argument("--json", action="store_true")

"""Which part of a dataset one extract process computes: ``extract --world-size N --rank K``.

The input's samples fall into fixed units (``[u*U, (u+1)*U)``, U = the batch size, or the shard
size with ``--shard-size``); rank K of N computes the units ``u`` with ``u % N == K``. Every rank
reads the same input and computes its units exactly as a one-engine run computes them (the same
batches), so the union of the N ranks' files is the one-engine dataset, byte for byte where the
kernels are deterministic. Round robin rather than contiguous ranges: sorted or length-grouped
inputs then spread their long samples over every rank.

Every rank writes into the same output directory (a shared filesystem); its own records live in
``OUT/rank_{K}/`` (outdir.py), so no two processes ever write the same file.

Without the flags the part comes from the launcher's environment: torchrun's ``RANK`` /
``WORLD_SIZE``, else Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS`` (one task per shard); the log
says which. torchrun's variables are removed from the environment once read, so that vLLM's own
distributed start-up (which runs inside each shard) never takes them for its own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("speculators_compat.pipeline")

#: (rank variable, size variable, launcher), in the order they are looked for
LAUNCHER_ENVS = (
    ("RANK", "WORLD_SIZE", "torchrun"),
    ("SLURM_PROCID", "SLURM_NTASKS", "Slurm"),
)
#: set by torchrun for its own rendezvous: read, then removed before vLLM starts
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


@dataclass(frozen=True)
class Part:
    """Rank ``rank`` of ``world_size``; ``source`` says where that came from (for the log)."""

    rank: int = 0
    world_size: int = 1
    source: str = "default"
    #: torchrun/Slurm's process index on this host and process count there (GPU pick), if known
    local_rank: int | None = None
    local_size: int | None = None

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.world_size}"

    def owns(self, index: int, unit: int) -> bool:
        """Whether sample ``index`` is this rank's (``unit``: ``partition_unit``)."""
        return (index // unit) % self.world_size == self.rank

    def records_dir(self, root: Path) -> Path:
        """Where this rank's records live: the output itself for a one-engine run."""
        return root / f"rank_{self.rank}" if self.sharded else root

    def sub(self, d: int, dp: int) -> Part:
        """Engine ``d`` of ``dp`` on this host, when this process is one of ``world_size`` hosts:
        rank ``rank * dp + d`` of ``world_size * dp``."""
        return Part(self.rank * dp + d, self.world_size * dp, f"{self.source}, data parallel engine {d} of {dp}")


def partition_unit(batch_size: int, shard_size: int = 1) -> int:
    """The samples that always go to one rank together: a batch, or a safetensors shard (which
    must then hold whole batches, else one file would need two ranks' samples)."""
    if shard_size > 1:
        if shard_size % batch_size:
            raise ValueError(
                f"--shard-size {shard_size} with --world-size > 1 must be a multiple of --batch-size "
                f"{batch_size}: each shard file is written by one rank, from whole batches"
            )
        return shard_size
    return batch_size


def _int(name: str, value) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def resolve_part(rank: int | None = None, world_size: int | None = None, environ=None) -> Part:
    """The part this process computes: the flags, else a launcher's environment, else the whole
    dataset. A ValueError names what is inconsistent."""
    env = os.environ if environ is None else environ
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError(f"--rank and --world-size go together (got --rank {rank}, --world-size {world_size})")
        part = Part(_int("--rank", rank), _int("--world-size", world_size), "--rank/--world-size")
    else:
        part = Part()
        for rank_var, size_var, launcher in LAUNCHER_ENVS:
            if rank_var in env and size_var in env:
                local = (
                    ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
                    if launcher == "torchrun"
                    else ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
                )
                lr, ls = (env.get(v) for v in local)
                part = Part(
                    _int(rank_var, env[rank_var]),
                    _int(size_var, env[size_var]),
                    f"{rank_var}/{size_var} ({launcher})",
                    _int(local[0], lr) if lr not in (None, "") else None,
                    _int(local[1], ls.split("(")[0]) if ls not in (None, "") else None,
                )
                break
    if part.world_size < 1:
        raise ValueError(f"world size must be >= 1, not {part.world_size} (from {part.source})")
    if not 0 <= part.rank < part.world_size:
        raise ValueError(f"rank must be in [0, {part.world_size}), not {part.rank} (from {part.source})")
    if part.sharded:
        logger.info("extracting %s (from %s)", part.label, part.source)
    return part


def forget_launcher_env(environ=None) -> list[str]:
    """Remove torchrun's rendezvous variables (already read) from the environment; returns which."""
    env = os.environ if environ is None else environ
    gone = [v for v in TORCHRUN_VARS if v in env]
    for v in gone:
        del env[v]
    if gone:
        logger.info(
            "removed %s from the environment (read for the shard; vLLM's distributed start-up must not see them)",
            ", ".join(gone),
        )
    return gone


# -- the parts' records


def merged_extra(done: dict[int, dict]) -> dict:
    """The manifest's run description from the ranks' done.json: what every rank computed alike
    (rank 0's); the hidden size from any rank that computed a sample. Ranks that ran other
    package versions are said in the log (run.json cannot tell: an upgrade may resume a run)."""
    first = done[min(done)]
    extra = dict(first["extra"])
    extra["hidden_size"] = next(
        (d["extra"].get("hidden_size") for d in done.values() if d["extra"].get("hidden_size")), None
    )
    for r, d in sorted(done.items()):
        if d["extra"].get("versions") != first["extra"].get("versions"):
            logger.warning(
                "rank %d ran other versions than rank %d (%s against %s); the manifest records rank %d's",
                r,
                min(done),
                d["extra"].get("versions"),
                first["extra"].get("versions"),
                min(done),
            )
    return extra


# -- placing engines on one host ---------------------------------------------------------------


def device_groups(visible: list[str], engines: int, tp: int) -> list[list[str]]:
    """``engines`` disjoint groups of ``tp`` devices from ``visible`` (in order): engine d gets
    devices ``[d*tp, (d+1)*tp)``. A ValueError says when there are too few."""
    need = engines * tp
    if need > len(visible):
        raise ValueError(
            f"{engines} engine(s) x tensor parallel {tp} need {need} GPUs; {len(visible)} are visible "
            f"({','.join(visible) or 'none'})"
        )
    return [visible[d * tp : (d + 1) * tp] for d in range(engines)]


def cpu_groups(cpus: list[int], engines: int, tp: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for each of ``engines`` CPU engines: the usable ``cpus``
    split into disjoint contiguous groups, one per engine, each split again per TP rank
    (``"0-3|4-7"``). A ValueError when there are fewer CPUs than TP ranks in all."""
    need = engines * tp
    if len(cpus) < need:
        raise ValueError(f"{engines} CPU engine(s) x tensor parallel {tp} need {need} CPUs; {len(cpus)} are usable")
    per_rank = len(cpus) // need
    out = []
    for d in range(engines):
        ranks = []
        for t in range(tp):
            first = (d * tp + t) * per_rank
            ranks.append(",".join(str(c) for c in cpus[first : first + per_rank]))
        out.append("|".join(ranks))
    return out


def visible_devices() -> list[str]:
    """The CUDA devices this process may use, by the ids CUDA_VISIBLE_DEVICES gives them (else
    0..n-1); [] on a host without CUDA."""
    from ..host import cuda_device_count

    n = cuda_device_count()
    if n == 0:
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None and given.strip():
        return [d.strip() for d in given.split(",") if d.strip()][:n]
    return [str(i) for i in range(n)]


def pick_local_devices(part: Part, tp: int) -> str | None:
    """Under a launcher that starts several shards on one host without assigning GPUs (torchrun
    does not set CUDA_VISIBLE_DEVICES), this shard's ``tp`` GPUs: group ``local_rank``. Sets
    CUDA_VISIBLE_DEVICES and returns it; None when there is nothing to pick (one shard per host,
    no GPU, or GPUs already assigned to exactly this shard's count)."""
    if part.local_size is None or part.local_size <= 1 or part.local_rank is None:
        return None
    visible = visible_devices()
    if not visible or len(visible) <= tp:
        return None  # (the launcher gave this shard its GPUs already, or there are none)
    group = device_groups(visible, part.local_size, tp)[part.local_rank]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(group)
    logger.info(
        "%s is process %d of %d on this host: using GPUs %s",
        part.label,
        part.local_rank,
        part.local_size,
        ",".join(group),
    )
    return os.environ["CUDA_VISIBLE_DEVICES"]

"""What ``extract`` says of a run without an engine: the dtype a ``--dtype`` names, the disk space
the run needs, the over-long samples it will cut or skip (before the engine starts), and whether
the run was bound by its writes (at the end)."""

from __future__ import annotations

import errno
import logging
import shutil

from ..errors import OutputError
from .plan import disk_bytes_per_token

logger = logging.getLogger("speculators_compat.pipeline")

#: --dtype spellings vLLM takes, by the torch dtype they name (what run.json records)
DTYPE_NAMES = {"float32": ("float32", "float"), "float16": ("float16", "half"), "bfloat16": ("bfloat16",)}


def dtype_name(dtype) -> str | None:
    """The torch dtype name an explicit ``dtype`` asks for (None: "auto", unset, or unknown)."""
    name = str(dtype).replace("torch.", "") if dtype is not None else ""
    return next((k for k, names in DTYPE_NAMES.items() if name in names), None)


def check_free_space(
    root, scan, to_compute: int, layers: int, hidden: int | None, dtype, states_dtype: str = "auto"
) -> int | None:
    """Refuse a run whose files cannot fit the output's free space (what ``plan`` prints as disk
    needed: the samples left to compute, at the model's hidden size; 2-byte states unless float32
    was asked for, so the estimate errs low). Unknown sizes (a hub id) are not checked. Returns the
    bytes estimated (None: unknown)."""
    if not to_compute:
        return 0
    if not hidden or not scan.tokens or not scan.samples:
        return None
    need = (
        scan.tokens
        * to_compute
        // scan.samples
        * disk_bytes_per_token(layers, hidden, 4 if dtype_name(dtype) == "float32" else 2, states_dtype)
    )
    free = shutil.disk_usage(root).free
    if need > free:
        raise OutputError(
            f"the {to_compute:,} samples left to compute need about {need / 2**30:,.1f} GiB in {root}, which has "
            f"{free / 2**30:,.1f} GiB free: free space, use an output on a larger disk, or --max-samples"
        )
    return need


def disk_full(e: BaseException | None) -> bool:
    """Whether ``e`` or an error behind it is a full disk (or a spent quota)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full_error(root, left: int, written: int, bytes_written: int, planned: int | None) -> OutputError:
    """What a run that filled its disk says: the bytes still needed for the ``left`` samples not
    written (at the size of those written, else the plan's), against what the plan said."""
    free = shutil.disk_usage(root).free
    per = bytes_written / written if written else (planned or 0) / max(left + written, 1)
    more = max(per * left - free, 0)
    plan = f"{planned / 1e9:,.1f} GB" if planned is not None else "unknown: the model's size was not known"
    return OutputError(
        f"no space left on {root}: {more / 1e9:,.1f} GB more needed (plan said {plan}); the {written:,} files "
        "written are complete: free space and rerun the same command to resume"
    )


def warn_overlength(over: list[tuple[int, int]], max_len: int, action: str) -> None:
    shown = ", ".join(f"sample {i} ({n:,} tokens)" for i, n in over[:20])
    logger.warning(
        "%d sample(s) longer than max_model_len - 1 = %d tokens will be %s: %s%s",
        len(over),
        max_len,
        action,
        shown,
        " ..." if len(over) > 20 else "",
    )


WRITE_BOUND_SHARE = 0.1  # of the compute phase spent waiting for the writers ...
WRITE_BOUND_MIN_S = 1.0  # ... and at least this long: then the run is said to be write-bound


def warn_if_write_bound(wait_s: float, write_s: float, write_mib_s: float, root) -> bool:
    """Say so (a warning) when the engine spent a real share of the run waiting for room in the
    writers' queue: the output disk, not the engine, then sets the pace, and nothing in the
    pipeline can go faster than the disk (measured: docs/benchmarks.md)."""
    if wait_s < max(WRITE_BOUND_MIN_S, WRITE_BOUND_SHARE * write_s):
        return False
    logger.warning(
        "the engine waited %.1f s of %.1f s (%.0f%%) for the file writers, which wrote %.0f MiB/s to "
        "%s: this run is bound by writing its output. A faster output disk would speed it up, or "
        "more writers (--writer-threads) if that disk is not busy.",
        wait_s,
        write_s,
        100 * wait_s / max(write_s, 1e-9),
        write_mib_s,
        root,
    )
    return True

"""Facts about this host that the engine and the pipeline size themselves by. Importing this
module imports nothing heavy; ``cuda_device_count`` imports torch only when called."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity masks
        return os.cpu_count() or 1


def has_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later Xeons), as torch detects them."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def cuda_device_count() -> int:
    """Visible CUDA devices, without initialising CUDA or poisoning fork (NVML where torch can)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda._is_compiled() else 0


def hold_exclusive(path: str, mode: int = 0o644) -> int:
    """Create ``path`` (if missing) and take an exclusive flock on it without waiting; returns the
    open descriptor (closing it, or the process dying, lets the lock go). OSError when another
    holds it."""
    import fcntl

    fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd

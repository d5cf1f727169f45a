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

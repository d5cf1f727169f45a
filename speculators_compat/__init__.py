"""speculators-compat: makes speculators 0.3.0 and 0.4.x offline hidden-state extraction correct on vLLM 0.11 -> 0.32.

``import speculators_compat`` installs post-import hooks (it imports neither vLLM nor torch); each
patch applies when its target module is imported, or at once if it already was. Workers get the same
patches through the ``vllm.general_plugins`` entry point. ``SPECULATORS_COMPAT_DISABLE=1`` turns it off.
"""

from __future__ import annotations

from . import hooks
from ._version import __version__  # noqa: E402
from .errors import (
    ArenaSpaceError,
    CaptureError,
    CheckpointError,
    DatasetError,
    OutputError,
    ShardFailedError,
    StallError,
    TokenIdError,
    WorkerDiedError,
    WriterProcessDied,
)


def patch() -> bool:
    """Enable all patches (idempotent). Returns False when disabled by SPECULATORS_COMPAT_DISABLE."""
    return hooks.install()


def unpatch() -> None:
    """Revert every applied patch, restoring the original objects."""
    hooks.uninstall()


def status() -> dict:
    """Structured report: installed versions, tested range, each patch's applies/applied/reason."""
    from .report import build_status

    return build_status()


def __getattr__(name):  # lazy: the generator imports torch/vLLM only when used
    if name == "VllmHiddenStatesGenerator":
        from .generator import VllmHiddenStatesGenerator

        return VllmHiddenStatesGenerator
    raise AttributeError(f"module 'speculators_compat' has no attribute {name!r}")


patch()

__all__ = [
    "patch",
    "unpatch",
    "status",
    "VllmHiddenStatesGenerator",
    "__version__",
    "ArenaSpaceError",
    "CaptureError",
    "CheckpointError",
    "DatasetError",
    "OutputError",
    "StallError",
    "TokenIdError",
    "WorkerDiedError",
    "ShardFailedError",
    "WriterProcessDied",
]

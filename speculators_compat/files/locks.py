"""The ``.lock`` protocol of a hidden-states file, as speculators' clients and vLLM's own connector
use it: ``<file>.lock`` exists, with an exclusive flock held by the writer, before the client is
told the file's path; the writer renames the whole file in, then lets the lock go; the client
takes the lock (``LOCK_EX | LOCK_NB``, polling), reads the file and removes the lock.

One owner for every step of it: the capture connector (connector/worker.py) and ``serve``'s file
routes ask here, nobody else opens a ``.lock``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os

from ..host import hold_exclusive

logger = logging.getLogger("speculators_compat.files")

LOCK_SUFFIX = ".lock"
PARTIAL_PREFIX = "."  # a file in the making is ``.<name>.partial`` (formats.write_parts)
PARTIAL_SUFFIX = ".partial"


def lock_path(path: str) -> str:
    return os.fspath(path) + LOCK_SUFFIX


def hold(path: str) -> int:
    """Create ``<path>.lock`` and take its exclusive flock; returns the open descriptor (closing
    it lets the lock go). Creates the folder when it is missing."""
    lp = lock_path(path)
    os.makedirs(os.path.dirname(lp) or ".", exist_ok=True)
    return hold_exclusive(lp)


def release(fd: int | None, path: str | None = None, remove: bool = False) -> None:
    """Let the lock ``fd`` go; ``remove``: also remove ``<path>.lock`` (nothing will be written, so
    no client is to wait on it; one already waiting then finds no file, which names the failure)."""
    if remove and path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path(path))
    if fd is not None:
        os.close(fd)


def is_held(path: str) -> bool:
    """Does a live process hold ``path`` (a ``.lock`` file) locked? (A lock whose holder died is
    free: the kernel drops a flock with its last descriptor.)"""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)
    return False


def sweep(folder: str) -> dict:
    """Remove what dead writers left in ``folder``: ``.lock`` files nobody holds whose data file
    is missing (a writer killed before it renamed its file in), and ``.*.partial`` temporaries whose
    ``.lock`` nobody holds. A lock a live process holds (a writer at work, a client reading) and a
    finished file's lock (its client has not taken it yet) are left alone. Returns the counts."""
    removed = {"locks": 0, "partials": 0}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        full = os.path.join(folder, name)
        if name.endswith(LOCK_SUFFIX):
            data = full[: -len(LOCK_SUFFIX)]
            if not os.path.exists(data) and not is_held(full):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
                    removed["locks"] += 1
        elif name.startswith(PARTIAL_PREFIX) and name.endswith(PARTIAL_SUFFIX):
            final = os.path.join(folder, name[len(PARTIAL_PREFIX) : -len(PARTIAL_SUFFIX)])
            if not is_held(lock_path(final)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
                    removed["partials"] += 1
    if removed["locks"] or removed["partials"]:
        logger.warning(
            "speculators_compat: removed %d stale .lock file(s) and %d temporary file(s) left in %s by a "
            "writer that died",
            removed["locks"],
            removed["partials"],
            folder,
        )
    return removed

"""Shared memory that engines killed with SIGKILL leave in /dev/shm.

vLLM's engine and workers talk through POSIX shared memory (Python's ``SharedMemory``, files named
``psm_*`` in /dev/shm, hundreds of MB an engine on CPU). A process killed with SIGKILL cannot
unlink them, and nothing else does: they hold host memory until reboot. A Ray shard whose actor
was killed is started again on the same host, so each attempt leaks one engine's worth.

``sweep_orphan_shm()`` removes those no process has open or mapped (read from /proc), and only
those older than a few seconds (a file is mapped by its creator at once; the age is the margin).
Files of another user are left alone: a process of ours could not open them anyway, so it cannot
tell whether they are in use.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("speculators_compat.engine")

PREFIXES = ("psm_",)  # Python's SharedMemory names, which vLLM's message queues use
MIN_AGE_S = 10.0


def _in_use(d: str) -> set[str]:
    """Names under ``d`` that a process we can see has mapped or open."""
    used: set[str] = set()
    me = os.getuid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        base = f"/proc/{pid}"
        try:
            if me != 0 and os.stat(base).st_uid != me:
                continue
            with open(f"{base}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    i = line.find(d + "/")
                    if i >= 0:
                        used.add(line[i + len(d) + 1 :].split()[0])
            for fd in os.listdir(f"{base}/fd"):
                target = os.readlink(f"{base}/fd/{fd}")
                if target.startswith(d + "/"):
                    used.add(target[len(d) + 1 :].split()[0])
        except OSError:  # (a process that ended meanwhile, or one we may not read)
            continue
    return used


def orphan_shm(d: str = "/dev/shm", min_age_s: float = MIN_AGE_S) -> list[tuple[str, int]]:
    """This user's ``psm_*`` files in ``d`` that no process has open or mapped (module docstring),
    with their sizes in bytes."""
    if not os.path.isdir(d) or not os.path.isdir("/proc/self/fd"):
        return []
    now, me = time.time(), os.getuid()
    candidates = {}
    for name in os.listdir(d):
        if not name.startswith(PREFIXES):
            continue
        try:
            st = os.stat(os.path.join(d, name))
        except FileNotFoundError:
            continue
        if st.st_uid == me and now - st.st_mtime >= min_age_s:
            candidates[name] = st.st_size
    if not candidates:
        return []
    used = _in_use(d)
    return [(name, size) for name, size in candidates.items() if name not in used]


def report_orphan_shm(d: str = "/dev/shm") -> int:
    """Say (a warning) how many orphan ``psm_*`` files ``d`` holds and how to remove them; returns
    the count. (Not removed here: a command that only reads a dataset has no business deleting
    files it did not make.)"""
    found = orphan_shm(d)
    if found:
        logger.warning(
            "speculators_compat: %d shared-memory file(s) in %s (%.0f MB) that no process has open, left by "
            "killed engines; remove them with: speculators-compat doctor --sweep-shm",
            len(found),
            d,
            sum(n for _, n in found) / 1e6,
        )
    return len(found)


def sweep_orphan_shm(d: str = "/dev/shm", min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove this user's ``psm_*`` files in ``d`` that no process has open or mapped (module
    docstring); returns their names."""
    removed = []
    for name, _ in orphan_shm(d, min_age_s):
        try:
            os.unlink(os.path.join(d, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    if removed:
        logger.info("speculators_compat: removed %d shared-memory file(s) of killed engines from %s", len(removed), d)
    return removed

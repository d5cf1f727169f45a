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


def _our_pids() -> list[str]:
    """The processes whose files we may read: all of them as root, else this user's."""
    me, pids = os.getuid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if me == 0 or os.stat(f"/proc/{pid}").st_uid == me:
                pids.append(pid)
        except OSError:  # (a process that ended meanwhile)
            continue
    return pids


def _held_open(d: str, pids: list[str]) -> set[str]:
    """Names under ``d`` that one of ``pids`` has open (its fd links: cheap to read)."""
    used: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(d + "/"):
                    used.add(target[len(d) + 1 :].split()[0])
        except OSError:  # (a process that ended meanwhile, or one we may not read)
            continue
    return used


def _mapped(d: str, pids: list[str], names: set[str]) -> set[str]:
    """Which of ``names`` under ``d`` one of ``pids`` maps (its maps file: thousands of lines in a
    GPU process, so read only for names no process has open, and no further once all are found)."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    i = line.find(d + "/")
                    if i >= 0 and (name := line[i + len(d) + 1 :].split()[0]) in names:
                        found.add(name)
        except OSError:
            continue
        if found == names:
            break
    return found


def _in_use(d: str, names: set[str]) -> set[str]:
    """Which of ``names`` under ``d`` a process we can see has open or mapped."""
    pids = _our_pids()
    used = _held_open(d, pids) & names
    if names - used:
        used |= _mapped(d, pids, names - used)
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
    used = _in_use(d, set(candidates))
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

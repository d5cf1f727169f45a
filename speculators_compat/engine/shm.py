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


def sweep_orphan_shm(d: str = "/dev/shm", min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove this user's ``psm_*`` files in ``d`` that no process has open or mapped (module
    docstring); returns their names."""
    if not os.path.isdir(d) or not os.path.isdir("/proc/self/fd"):
        return []
    now, me = time.time(), os.getuid()
    candidates = []
    for name in os.listdir(d):
        if not name.startswith(PREFIXES):
            continue
        try:
            st = os.stat(os.path.join(d, name))
        except FileNotFoundError:
            continue
        if st.st_uid == me and now - st.st_mtime >= min_age_s:
            candidates.append(name)
    if not candidates:
        return []
    used = _in_use(d)
    removed = []
    for name in candidates:
        if name in used:
            continue
        try:
            os.unlink(os.path.join(d, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    if removed:
        logger.info("speculators_compat: removed %d shared-memory file(s) of killed engines from %s", len(removed), d)
    return removed

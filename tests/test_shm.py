"""Shared memory left by engines killed with SIGKILL (engine/shm.py): a real ``SharedMemory`` made
by a process that is then killed stays in /dev/shm; the sweep removes it, and leaves alone one a
live process holds open and maps, one it only maps (its fd closed: found in its maps alone), one
another process holds open, and a fresh one."""

import os
import signal
import subprocess
import sys
import time

import pytest

from speculators_compat.engine.shm import sweep_orphan_shm

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or not os.path.isdir("/proc/self/fd"), reason="Linux only"
)

MAKE = """
import os, sys, time
from multiprocessing import shared_memory, resource_tracker
m = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(m._name, "shared_memory")  # (as vLLM's queues: no tracker to clean up)
if sys.argv[1] == "map-only":  # mapped through libc, its fd closed (Python's mmap keeps one open)
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    m.close()
    fd = os.open("/dev/shm/" + m.name.lstrip("/"), os.O_RDWR)
    assert libc.mmap(None, 1 << 20, 3, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # (shared, rw)
    os.close(fd)
print(m.name, flush=True)
time.sleep(600)
"""


def _make(keep_mapped: bool, how: str = "open"):
    p = subprocess.Popen([sys.executable, "-c", MAKE, how], stdout=subprocess.PIPE, text=True)
    name = p.stdout.readline().strip().lstrip("/")
    if not keep_mapped:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return p, name


def test_a_killed_engines_shared_memory_is_removed_and_live_ones_stay():
    dead_p, dead = _make(keep_mapped=False)
    live_p, live = _make(keep_mapped=True)
    mapped_p, mapped = _make(keep_mapped=True, how="map-only")
    opened = None
    try:
        assert not any(
            os.readlink(f"/proc/{mapped_p.pid}/fd/{fd}").endswith(mapped)
            for fd in os.listdir(f"/proc/{mapped_p.pid}/fd")
        )
        _, held = _make(keep_mapped=False)
        opened = os.open(f"/dev/shm/{held}", os.O_RDONLY)  # (open, not mapped: still in use)
        assert os.path.exists(f"/dev/shm/{dead}")  # SIGKILL left it
        assert dead not in sweep_orphan_shm(min_age_s=60)  # too fresh to judge
        past = time.time() - 120
        for n in (dead, live, mapped, held):
            os.utime(f"/dev/shm/{n}", (past, past))
        removed = sweep_orphan_shm()
        assert dead in removed and not os.path.exists(f"/dev/shm/{dead}")
        assert live not in removed and os.path.exists(f"/dev/shm/{live}")
        assert mapped not in removed and os.path.exists(f"/dev/shm/{mapped}")
        assert held not in removed and os.path.exists(f"/dev/shm/{held}")
    finally:
        for q in (live_p, mapped_p):
            q.kill()
            q.wait()
        if opened is not None:
            os.close(opened)
        for n in (live, mapped, dead, locals().get("held")):
            if n and os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


def test_orphans_are_reported_with_the_command_and_doctor_removes_them(caplog):
    """extract says how many orphans /dev/shm holds and how to remove them (it removes nothing);
    ``doctor --sweep-shm`` removes them, and only them."""
    import logging

    from speculators_compat.cli import main
    from speculators_compat.engine.shm import report_orphan_shm

    dead_p, dead = _make(keep_mapped=False)
    live_p, live = _make(keep_mapped=True)
    try:
        past = time.time() - 120
        for n in (dead, live):
            os.utime(f"/dev/shm/{n}", (past, past))
        with caplog.at_level(logging.WARNING, logger="speculators_compat.engine"):
            assert report_orphan_shm() >= 1
        assert "speculators-compat doctor --sweep-shm" in caplog.text and os.path.exists(f"/dev/shm/{dead}")
        assert main(["doctor", "--sweep-shm"]) == 0
        assert not os.path.exists(f"/dev/shm/{dead}") and os.path.exists(f"/dev/shm/{live}")
    finally:
        live_p.kill()
        live_p.wait()
        for n in (live, dead):
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")

"""The ``.lock`` protocol (files/locks.py): a lock is held while its file is written and goes when
the writer lets it go or dies; the start-up sweep removes what dead writers left and never a lock a
live process holds, nor the lock of a finished file its client has not taken yet."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from speculators_compat.files import locks


def test_hold_release_and_remove(tmp_path):
    path = str(tmp_path / "sub" / "a.safetensors")
    fd = locks.hold(path)  # (makes the folder)
    assert locks.is_held(path + ".lock")
    locks.release(fd, path)
    assert os.path.exists(path + ".lock") and not locks.is_held(path + ".lock")
    locks.release(None, path, remove=True)
    assert not os.path.exists(path + ".lock")


def test_a_lock_held_by_a_dead_process_is_free(tmp_path):
    lock = tmp_path / "a.safetensors.lock"
    code = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        assert locks.is_held(str(lock))
    finally:
        p.kill()
        p.wait()
    assert not locks.is_held(str(lock))


def test_the_sweep_removes_only_what_dead_writers_left(tmp_path):
    d = tmp_path
    (d / "dead.safetensors.lock").write_bytes(b"")  # writer died before renaming its file in
    (d / ".dead.safetensors.partial").write_bytes(b"half")
    (d / "done.safetensors").write_bytes(b"file")  # finished: its client has not taken the lock yet
    (d / "done.safetensors.lock").write_bytes(b"")
    (d / "live.safetensors.lock").write_bytes(b"")  # a writer at work
    (d / ".live.safetensors.partial").write_bytes(b"half")
    fd = os.open(d / "live.safetensors.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        assert locks.sweep(str(d)) == {"locks": 1, "partials": 1}
        assert time.monotonic() - t0 < 1
    finally:
        os.close(fd)
    left = sorted(os.listdir(d))
    assert left == [".live.safetensors.partial", "done.safetensors", "done.safetensors.lock", "live.safetensors.lock"]

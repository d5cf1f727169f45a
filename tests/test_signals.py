"""signals.py: SIGTERM / SIGHUP raise Terminated (a KeyboardInterrupt) once, in a process of their own
(the real signal, delivered by the kernel); the pipeline-level test is
tests/engine/test_pipeline_cli.py::test_sigterm_shuts_down_cleanly_and_resume_is_identical."""

import signal
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, signal, sys
from speculators_compat.signals import Terminated, handle_termination, interrupted
seen = []
signal.signal(signal.SIGHUP, lambda s, f: seen.append("own"))  # the program's own handler stays
assert handle_termination() is True
try:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10**7):
        pass
    print("NOT RAISED")
except KeyboardInterrupt as e:
    assert isinstance(e, Terminated) and e.signum == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # a second one during the clean-up is ignored
    os.kill(os.getpid(), signal.SIGHUP)   # the program's own SIGHUP handler still runs
    msg, code = interrupted(e, "/data/out")
    print(code, msg)
print("alive", seen)
"""


def test_sigterm_raises_once_and_names_the_resume():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "143 interrupted by SIGTERM; the files already in /data/out are complete: run the same command again to resume"
    )
    assert lines[1] == "alive ['own']"


def test_ctrl_c_message_and_a_program_handler_is_kept():
    from speculators_compat.signals import interrupted

    assert interrupted(KeyboardInterrupt()) == ("interrupted by SIGINT", 130)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal\n"
            # SIGHUP as a login shell leaves it (under nohup it arrives ignored, and stays so: below)
            "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
            "signal.signal(signal.SIGTERM, lambda s, f: print('own'))\n"
            "from speculators_compat.signals import handle_termination\n"
            "print(handle_termination())\n"  # SIGHUP only
            "os.kill(os.getpid(), signal.SIGTERM)\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.split() == ["True", "own"], (r.stdout, r.stderr)


def test_an_ignored_hangup_stays_ignored():
    """Under nohup SIGHUP arrives ignored: the library keeps that (and installs SIGTERM's handler)."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import signal\n"
            "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
            "from speculators_compat.signals import handle_termination\n"
            "print(handle_termination(), signal.getsignal(signal.SIGHUP) is signal.SIG_IGN,"
            " signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN))\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.split() == ["True", "True", "True"], (r.stdout, r.stderr)


HANGS = """
import ctypes, signal, sys, time
from speculators_compat.signals import exit_by_deadline, handle_termination
handle_termination()
assert exit_by_deadline(grace_s=float(sys.argv[1]))
try:  # (a signal that lands while "ready" is printed unwinds into the hanging clean-up too)
    print("ready", flush=True)
    if sys.argv[2] == "c":  # the main thread stuck in C: no Python handler runs
        ctypes.CDLL(None).pause()
        while True:
            ctypes.CDLL(None).pause()
    while True:
        time.sleep(0.1)
finally:
    while True:  # a shutdown that waits on a host that is gone
        time.sleep(0.1)
"""


@pytest.mark.parametrize("where", ["cleanup", "c"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_shutdown_that_hangs_ends_by_the_deadline(sig, where):
    """SIGTERM / SIGINT end the command within the grace period whatever its clean-up waits on (a
    lost host: the engine's shutdown never returns) or the main thread is stuck in: the message
    says so and how to resume, exit 128 + signal."""
    import time

    p = subprocess.Popen(
        [sys.executable, "-c", HANGS, "2", where], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "ready"
    t = time.monotonic()
    p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the process did not end within 30 s of the signal")
    took = time.monotonic() - t
    assert p.returncode == 128 + sig, err
    assert 1.5 < took < 10, took
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"speculators-compat: the engine did not shut down within 2 s of {signal.Signals(sig).name}")
    ), err
    assert "run the same command again to resume" in err

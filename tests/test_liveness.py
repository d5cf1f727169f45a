"""engine/liveness.py over real sockets and real processes: a node killed with SIGKILL, a node
that goes silent, a driver that goes away, and a driver that ends normally (no loss reported)."""

import signal
import socket
import subprocess
import sys
import threading
import time

from speculators_compat.engine.liveness import DriverWatch, keep_alive


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NODE = """
import sys, threading, time
from speculators_compat.engine.liveness import keep_alive
lost = []
keep_alive("127.0.0.1", int(sys.argv[1]), 1, float(sys.argv[2]), lost.append, threading.Event())
print("up", flush=True)
while not lost:
    time.sleep(0.05)
print("LOST", lost[0], flush=True)
"""


def _watch(port, timeout_s):
    lost, seen = [], threading.Event()
    w = DriverWatch("127.0.0.1", port, timeout_s, lambda x: (lost.append(x), seen.set()))
    return w, lost, seen


def test_a_node_killed_is_noticed_at_once_and_named():
    port = _port()
    w, lost, seen = _watch(port, 30)
    node = subprocess.Popen([sys.executable, "-c", NODE, str(port), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert node.stdout.readline().strip() == "up"
        time.sleep(3)  # (connected, a beat or two exchanged)
        assert not lost
        t = time.monotonic()
        node.send_signal(signal.SIGKILL)
        assert seen.wait(10), "the driver did not notice the killed node"
        assert time.monotonic() - t < 5
        assert (
            lost[0].rank == 1
            and "closed its connection" in str(lost[0])
            and str(lost[0]).startswith("node 1 (127.0.0.1)")
        )
    finally:
        node.kill()
        w.close()


def test_a_silent_node_is_lost_after_the_timeout():
    port = _port()
    w, lost, seen = _watch(port, 1.5)
    try:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"node 3\n")  # ... and never a beat (a host whose network went away)
        t = time.monotonic()
        assert seen.wait(10)
        assert 1.0 < time.monotonic() - t < 5 and lost[0].rank == 3 and "sent nothing for 2 s" in str(lost[0])
        s.close()
    finally:
        w.close()


def test_a_driver_that_goes_away_is_noticed_by_its_node_and_a_normal_end_is_no_loss():
    port = _port()
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom speculators_compat.engine.liveness import DriverWatch\n"
            f"w = DriverWatch('127.0.0.1', {port}, 30, print)\nprint('up', flush=True)\ntime.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    lost, done = [], threading.Event()
    try:
        assert driver.stdout.readline().strip() == "up"
        keep_alive("127.0.0.1", port, 1, 30, lost.append, done)
        time.sleep(3)
        assert not lost
        driver.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and lost[0].rank == 0 and "closed its connection" in lost[0].reason
    finally:
        driver.kill()
        done.set()
    # a driver that ends normally says goodbye: its node reports nothing
    port = _port()
    w, driver_lost, _ = _watch(port, 30)
    lost2, done2 = [], threading.Event()
    t = keep_alive("127.0.0.1", port, 1, 30, lost2.append, done2)
    time.sleep(3)
    w.close()
    t.join(10)
    assert not t.is_alive() and not lost2 and not driver_lost
    done2.set()

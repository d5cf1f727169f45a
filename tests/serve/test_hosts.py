"""``serve`` over several hosts when one is lost (serve/hosts.py), with the real host watch over
real sockets and a real node process killed with SIGKILL. The server's process runs our middleware
around an app that never answers: what vLLM's app does while its engine waits on a lost host (the
engine itself over two hosts is tests/engine/test_serve_hosts.py's). A request in flight gets 503
naming the host, so does ``/health``, and the process ends with exit 2, its last line naming the
host."""

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER = """
import asyncio, json, sys
from speculators_compat.serve import hosts
from speculators_compat.serve.files import HiddenStatesFiles

port = int(sys.argv[1])
hosts.start(hosts.Watch("127.0.0.1", port, 30.0))
print("ready", flush=True)

async def engine_waits_for_ever(scope, receive, send):
    await asyncio.sleep(3600)

async def ask(mw, method, path):
    got = []
    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}
    async def send(msg):
        got.append(msg)
    scope = {"type": "http", "method": method, "path": path, "headers": [], "root_path": ""}
    await mw(scope, receive, send)
    return got[0]["status"], json.loads(got[1]["body"])["error"]["message"]

async def main():
    mw = HiddenStatesFiles(engine_waits_for_ever, {"watching": True})
    status, msg = await ask(mw, "POST", "/v1/completions")  # in flight when the node dies
    print("in flight:", status, msg, flush=True)
    status, msg = await ask(mw, "GET", "/health")
    print("health:", status, flush=True)
    await asyncio.sleep(3600)  # (hosts ends the process)

asyncio.run(main())
"""

NODE = """
import sys, threading, time
from speculators_compat.engine.liveness import keep_alive
keep_alive("127.0.0.1", int(sys.argv[1]), 1, 30.0, lambda lost: None, threading.Event())
time.sleep(3600)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_lost_host_fails_requests_in_flight_and_health_with_503_and_ends_the_server():
    from speculators_compat.serve import hosts

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    node = subprocess.Popen([sys.executable, "-c", NODE, str(port)], cwd=ROOT)
    try:
        assert server.stdout.readline().strip() == "ready"
        time.sleep(3)  # (the node connects and beats)
        node.send_signal(signal.SIGKILL)
        t = time.monotonic()
        out, err = server.communicate(timeout=hosts.STOP_AFTER_S + 30)
        took = time.monotonic() - t
    finally:
        for p in (server, node):
            if p.poll() is None:
                p.kill()
    lines = out.splitlines()
    assert lines[0].startswith("in flight: 503 lost node 1 (127.0.0.1) closed its connection"), out
    assert lines[1] == "health: 503", out
    assert server.returncode == 2, err
    assert err.strip().splitlines()[-1].startswith("speculators-compat serve: error: lost node 1 (127.0.0.1)"), err
    assert hosts.STOP_AFTER_S - 1 < took < hosts.STOP_AFTER_S + 10, took

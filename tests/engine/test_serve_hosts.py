"""``serve`` over two hosts on this machine (vLLM's multiprocessing executor, ``--nnodes 2``, tensor
parallel over them; ``speculators-compat node --node-rank 1`` is the second host), and the second
host killed with SIGKILL while a request is in flight: that request and ``/health`` answer 503
naming the host, SIGTERM then ends the server within 30 s, exit 2, its last line naming the host,
and nothing of it is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.engine.test_serve import chat_model, free_port, post, request, start_server, stop_server  # noqa: F401

pytestmark = [pytest.mark.ends, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_a_lost_host_fails_serve_with_503_and_sigterm_ends_it(chat_model, tmp_path, monkeypatch):  # noqa: F811
    hosts = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    hosts += ["--master-port", str(free_port())]
    engine = ["--model", chat_model, "--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "128"]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="1", PYTHONPATH=str(ROOT))
    node = subprocess.Popen(
        [sys.executable, "-m", "speculators_compat.cli", "node", *engine, *hosts, "--node-rank", "1"],
        env=env,
        start_new_session=True,
    )
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    srv = start_server(chat_model, tmp_path / "hs", *hosts)
    try:
        status, body = post(srv["url"] + "/v1/completions", {"model": chat_model, "prompt": [5, 6, 7], "max_tokens": 1})
        assert status == 200, body  # (both hosts serve)
        answer = {}

        def long_request():
            answer["r"] = request(
                srv["url"] + "/v1/completions",
                {"model": chat_model, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True},
                timeout=200,
            )

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        t.join(timeout=90)
        assert not t.is_alive(), "the request in flight was not answered"
        assert answer["r"][0] == 503 and b"lost node 1 (127.0.0.1)" in answer["r"][1], answer
        assert request(srv["url"] + "/health", timeout=10)[0] == 503
        start = time.monotonic()
        srv["proc"].send_signal(signal.SIGTERM)
        srv["proc"].wait(timeout=40)
        took = time.monotonic() - start
        assert took < 30, took
        assert srv["proc"].returncode != 0
        log = Path(srv["log"].name).read_text().strip().splitlines()
        assert any("lost node 1 (127.0.0.1)" in line for line in log[-5:]), log[-20:]
        time.sleep(2)
        left = subprocess.run(["pgrep", "-s", str(srv["proc"].pid)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes of the server left running: {left}"
    finally:
        stop_server(srv)
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)

"""``serve`` over several hosts (``--nnodes``): the driver's host watches the others.

vLLM's server does not notice a lost host: its engine waits on the lost workers for ever, ``/health``
keeps answering 200 and SIGTERM's shutdown waits too. So, as ``extract`` does (engine/liveness.py),
the serving host listens where its ``speculators-compat node`` hosts beat (``master_port + 1``).
When one is lost, every answer becomes 503 naming it (``/health`` first, so a load balancer takes
the server out), each request in flight is failed with 503, and the server ends ``STOP_AFTER_S``
seconds later, exit 2, its last line naming the host: vLLM's own shutdown would wait on the lost
workers. ``files.HiddenStatesFiles`` (our middleware in vLLM's app) asks ``lost()``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

from ..engine.liveness import DEFAULT_TIMEOUT_S, PORT_OFFSET, DriverWatch, Lost

logger = logging.getLogger("speculators_compat.serve")

STOP_AFTER_S = 15.0  # from the loss to the end: clients and probes see the 503s meanwhile
POLL_S = 0.5  # how often a request in flight looks whether a host was lost
LOSS_WINDOW_S = 2.0  # how long an engine's error answer waits to be told apart from a lost host
VLLM_MASTER_PORT = 29501  # vLLM's default --master-port (EngineArgs / ParallelConfig)


@dataclass(frozen=True)
class Watch:
    """Where the serving host listens for its nodes, and how long a silence may last."""

    addr: str
    port: int
    timeout_s: float


_lost: Lost | None = None
_lock = threading.Lock()


def watch_of(args: argparse.Namespace) -> Watch | None:
    """The watch ``args`` ask for (None: one host)."""
    if int(args.nnodes or 1) < 2:
        return None
    port = int(args.master_port or VLLM_MASTER_PORT) + PORT_OFFSET
    return Watch(args.master_addr, port, float(args.liveness_timeout_s or DEFAULT_TIMEOUT_S))


def start(watch: Watch | None) -> DriverWatch | None:
    """Listen for the nodes (before vLLM starts: they connect as soon as they start)."""
    if watch is None:
        return None
    return DriverWatch(watch.addr, watch.port, watch.timeout_s, host_lost)


def lost() -> Lost | None:
    """The host that was lost, or None."""
    return _lost


def host_lost(gone: Lost) -> None:
    """A node is gone: from now on every answer is 503; the server ends STOP_AFTER_S later."""
    global _lost
    with _lock:
        if _lost is not None:
            return
        _lost = gone
    print(
        f"speculators-compat serve: error: lost {gone}; answering 503 and stopping in {STOP_AFTER_S:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    threading.Thread(target=_stop, args=(gone,), name="speculators-compat-stop", daemon=True).start()


def message(gone: Lost) -> str:
    return f"lost {gone}: this server is stopping; restart it (and the node) to serve again"


def _stop(gone: Lost) -> None:
    time.sleep(STOP_AFTER_S)
    finish(gone)


def finish(gone: Lost) -> None:
    """End the server after a lost host: its engine's processes, the last line naming the host,
    exit 2 (also where vLLM's server stopped first, on SIGTERM)."""
    from ..signals import end_process

    _end_children()
    print(f"speculators-compat serve: error: {message(gone)}", file=sys.stderr, flush=True)
    end_process(2)


def _end_children() -> None:
    """SIGKILL this process's descendants (vLLM's engine core and its workers, which wait on the lost
    host and would outlive an ``os._exit``)."""
    import signal

    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # (a process that ended meanwhile)
                continue
            kids.setdefault(ppid, []).append(int(d))
    todo, seen = list(kids.get(os.getpid(), [])), []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += kids.get(pid, [])
    for pid in seen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


async def unless_lost(call, send, refuse) -> None:
    """Run the app's ``call(send)`` for one request; if a host is lost meanwhile, cancel it and
    answer with ``refuse(send, gone)`` (503) where the answer had not started. An error the engine
    answers with itself (a collective over the lost host fails: vLLM's 500) is replaced by that 503
    when the loss is heard within ``LOSS_WINDOW_S``."""
    started, replaced = False, False

    async def tracking(msg):
        nonlocal started, replaced
        if replaced:  # (the rest of an answer our 503 replaced)
            return
        if msg["type"] == "http.response.start" and not started:
            started = True
            gone = await _lost_within(LOSS_WINDOW_S) if msg["status"] >= 500 else None
            if gone is not None:
                replaced = True
                await refuse(send, gone)
                return
        await send(msg)

    task = asyncio.ensure_future(call(tracking))
    while True:
        done, _ = await asyncio.wait({task}, timeout=POLL_S)
        if done:
            return task.result()
        gone = lost()
        if gone is not None and not started:
            task.cancel()
            await refuse(send, gone)
            return None


async def _lost_within(seconds: float) -> Lost | None:
    deadline = time.monotonic() + seconds
    while lost() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return lost()

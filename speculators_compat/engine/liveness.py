"""Whether the hosts of an engine over several hosts are still there (node.py's engines).

vLLM's multiprocessing executor watches the worker processes of its own host only: a lost host
(its ``speculators-compat node`` killed, the machine gone, the link cut) leaves the driver waiting
on its message queues for ever, and the other hosts' workers waiting on the driver. So the driver
listens on ``master_port + PORT_OFFSET`` of ``master_addr`` and every node keeps a connection to it:
the node sends a byte every ``BEAT_S`` seconds and the driver answers each. Either side that sees
the connection close, or hears nothing for ``timeout_s`` seconds, calls its ``on_lost`` with a
``Lost`` record; a driver that ends normally first says goodbye (``BYE``), so its nodes end quietly.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("speculators_compat.engine")

PORT_OFFSET = 1  # the liveness port: master_port + 1 on the driver's host
BEAT_S = 2.0
DEFAULT_TIMEOUT_S = 60.0
BEAT, BYE = b".", b"x"


@dataclass
class Lost:
    """A host that is gone, as the other side saw it."""

    rank: int  # its node rank (0: the driver)
    host: str  # its address (as this side saw it)
    reason: str

    def __str__(self) -> str:
        return f"node {self.rank} ({self.host}) {self.reason}"


def _watch(conn: socket.socket, timeout_s: float, answer: bool, closing: threading.Event) -> str | None:
    """Read beats from ``conn`` until it fails; returns why (None: a goodbye, or we are closing)."""
    conn.settimeout(timeout_s)
    while not closing.is_set():
        try:
            data = conn.recv(64)
        except TimeoutError:
            return f"sent nothing for {timeout_s:.0f} s"
        except OSError as e:
            return f"dropped its connection ({e.strerror or e})"
        if closing.is_set() or BYE in data:
            return None
        if not data:
            return "closed its connection (its process was killed, or its host went down)"
        if answer:
            try:
                conn.sendall(BEAT)
            except OSError as e:
                return f"dropped its connection ({e.strerror or e})"
    return None


class DriverWatch:
    """The driver's side: accepts each node's connection and watches it (a thread each)."""

    def __init__(self, addr: str, port: int, timeout_s: float, on_lost):
        self.timeout_s, self.on_lost = timeout_s, on_lost
        self.closing = threading.Event()
        self.conns: list[socket.socket] = []
        self.server = socket.create_server((addr, port))
        self.server.settimeout(0.5)
        threading.Thread(target=self._accept, name="speculators-compat-liveness", daemon=True).start()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                conn, peer = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._node, args=(conn, peer[0]), daemon=True).start()

    def _node(self, conn: socket.socket, host: str) -> None:
        conn.settimeout(self.timeout_s)
        try:
            hello = conn.recv(64).decode("ascii", "replace").split()
            rank = int(hello[1]) if len(hello) >= 2 and hello[0] == "node" else -1
        except (OSError, ValueError):
            return
        why = _watch(conn, self.timeout_s, answer=True, closing=self.closing)
        if why is not None and not self.closing.is_set():
            self.on_lost(Lost(rank, host, why))

    def close(self) -> None:
        """The driver ends normally: every node is told so, then the connections close."""
        self.closing.set()
        for c in list(self.conns):
            try:
                c.sendall(BYE)
                c.close()
            except OSError:
                continue  # (that node is gone already: nothing to tell it)
        self.server.close()


def keep_alive(addr: str, port: int, rank: int, timeout_s: float, on_lost, done: threading.Event) -> threading.Thread:
    """A node's side: connect to the driver (retrying while it starts), beat, and call ``on_lost``
    if the driver goes away without saying goodbye. Ends when ``done`` is set."""

    def run() -> None:
        conn = None
        while conn is None and not done.is_set():
            try:
                conn = socket.create_connection((addr, port), timeout=5)
            except OSError:
                time.sleep(1.0)
        if conn is None:
            return
        with conn:
            conn.sendall(f"node {rank}\n".encode())
            beat = threading.Thread(target=_beat, args=(conn, done), daemon=True)
            beat.start()
            why = _watch(conn, timeout_s, answer=False, closing=done)
        if why is not None and not done.is_set():
            on_lost(Lost(0, addr, why))

    t = threading.Thread(target=run, name="speculators-compat-liveness", daemon=True)
    t.start()
    return t


def _beat(conn: socket.socket, done: threading.Event) -> None:
    while not done.wait(BEAT_S):
        try:
            conn.sendall(BEAT)
        except OSError:
            return  # (the watching side reports it)

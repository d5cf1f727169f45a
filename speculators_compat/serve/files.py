"""``HiddenStatesFiles``: an ASGI middleware for vLLM's own server (``--middleware
speculators_compat.serve.files.HiddenStatesFiles``) that adds what a hidden-states server needs
beside vLLM's API:

    GET    /<name>.safetensors   a finished file of the hidden-states folder, for a trainer on another
    DELETE /<name>.safetensors   host (speculators' ``http`` hidden-states backend asks these)

and guards every request:

- a file name is a bare name (letters, digits, ``._-``, at most 200 characters): anything else is
  404; the file is opened with ``O_NOFOLLOW`` inside the folder and must be a regular file, so a
  symlink placed there is never followed;
- nothing blocks the event loop: opening, reading, unlinking and waiting for a writer's ``.lock``
  run in threads or poll;
- the file routes answer 401 without the server's API key when it has one (vLLM guards ``/v1``);
- a request body over the cap is 413, a JSON body nested deeper than the JSON parser can take 400;
- a request that may be captured while the folder has less free space than one request of
  ``max_model_len`` tokens needs is 507, naming the folder and the bytes (no file, no lock left).

Settings come from the environment ``speculators-compat serve`` sets (``SETTINGS_ENV``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import stat

from .. import envs
from ..files import locks
from . import hosts

SETTINGS_ENV = "SPECULATORS_COMPAT_SERVE_FILES"  # JSON: folder, tokens, max_body, reserve (envs.py)
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}\.safetensors")
CAPTURING = ("/v1/completions", "/v1/chat/completions")
MAX_DEPTH = 256  # deeper JSON is refused (Python's parser raises RecursionError near 1,000)
CHUNK = 1 << 20
LOCK_WAIT_S = 60.0


class HiddenStatesFiles:
    def __init__(self, app, settings: dict | None = None):
        self.app = app
        cfg = settings if settings is not None else json.loads(envs.get(SETTINGS_ENV) or "{}")
        self.folder = os.path.realpath(cfg["folder"]) if cfg.get("folder") else None
        self.tokens = [t for t in cfg.get("tokens") or () if t]
        self.max_body = int(cfg.get("max_body") or 32 << 20)
        self.reserve = int(cfg.get("reserve") or 0)
        self.watching = bool(cfg.get("watching"))  # several hosts: a lost one fails every request (hosts.py)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gone = hosts.lost()
        if gone is not None:  # (/health too: a load balancer takes the server out)
            return await _refuse(send, gone)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope["method"]
        if self.folder and path.endswith(".safetensors") and method in ("GET", "DELETE"):
            return await self._file(scope, send, path[1:], method)
        if method in ("POST", "PUT", "PATCH"):
            body = await self._body(scope, receive, send)
            if body is None:
                return None
            problem = _json_problem(scope, body)
            if problem:
                return await _error(send, 400, problem, "BadRequestError")
            if path in CAPTURING and self.folder and self.reserve:
                free = await asyncio.to_thread(lambda: shutil.disk_usage(self.folder).free)
                if free < self.reserve:
                    msg = (
                        f"no space left on {self.folder}: {free:,} bytes free, a request's hidden states "
                        f"need up to {self.reserve:,}"
                    )
                    return await _error(send, 507, msg, "InsufficientStorageError")
            return await self._inner(scope, _replay(body, receive), send)
        return await self._inner(scope, receive, send)

    async def _inner(self, scope, receive, send):
        """vLLM's app for this request; over several hosts, failed with 503 if one is lost meanwhile."""
        if not self.watching:
            return await self.app(scope, receive, send)
        return await hosts.unless_lost(lambda s: self.app(scope, receive, s), send, _refuse)

    async def _body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once a 413 was sent (over the cap, by its header or as it came)."""
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _error(send, 413, f"the request body is over {self.max_body:,} bytes", "RequestTooLargeError")
            return None
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _error(send, 413, f"the request body is over {self.max_body:,} bytes", "RequestTooLargeError")
                return None
            parts.append(chunk)
            if not msg.get("more_body", False):
                break
        return b"".join(parts)

    def _authorized(self, scope) -> bool:
        if not self.tokens:
            return True
        value = (_header(scope, b"authorization") or "").partition(" ")
        return value[0].lower() == "bearer" and value[2] in self.tokens

    async def _file(self, scope, send, name: str, method: str):
        if not self._authorized(scope):
            return await _error(send, 401, "Unauthorized", "AuthenticationError", code=401)
        if not NAME.fullmatch(name):
            return await _error(send, 404, "no such file", "NotFoundError")
        full = os.path.join(self.folder, name)
        if method == "DELETE":
            gone = await asyncio.to_thread(_delete, full)
            if not gone:
                return await _error(send, 404, "no such file", "NotFoundError")
            await send({"type": "http.response.start", "status": 204, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        if not await _lock_free(full):
            return await _error(send, 503, f"{name} is still being written", "ServiceUnavailableError")
        try:
            fd, size = await asyncio.to_thread(_open_regular, full)
        except FileNotFoundError:
            return await _error(send, 404, "no such file", "NotFoundError")
        try:
            head = [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            at = 0
            while at < size:
                chunk = await asyncio.to_thread(os.pread, fd, min(CHUNK, size - at), at)
                if not chunk:
                    break
                at += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": at < size})
            if at >= size and size == 0:
                await send({"type": "http.response.body", "body": b""})
        finally:
            os.close(fd)
        return None


def _header(scope, key: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == key:
            return v.decode("latin-1")
    return None


def _json_problem(scope, body: bytes) -> str | None:
    """Why a JSON body cannot be parsed safely (nested too deep), or None. Counting brackets is
    C-speed; only a body with that many of them is walked."""
    kind = (_header(scope, b"content-type") or "").lower()
    if "json" not in kind or body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return None
    depth = 0
    in_str = esc = False
    for b in body:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                return f"the request body's JSON is nested deeper than {MAX_DEPTH} levels"
        elif b in (0x5D, 0x7D):
            depth -= 1
    return None


def _replay(body: bytes, receive):
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _open_regular(full: str) -> tuple[int, int]:
    """An open descriptor on ``full`` and its size: a regular file, reached without following a
    symlink (FileNotFoundError for anything else)."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:  # ELOOP: a symlink; ENOENT; ENAMETOOLONG: all "no such file" to a client
        raise FileNotFoundError(full) from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileNotFoundError(full)
    return fd, st.st_size


def _delete(full: str) -> bool:
    if os.path.islink(full) or not os.path.isfile(full):
        return False
    os.unlink(full)
    locks.release(None, full, remove=True)
    return True


async def _lock_free(full: str) -> bool:
    """Wait (polling, off the event loop) while a writer holds the file's lock."""
    lock = locks.lock_path(full)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOCK_WAIT_S
    while await asyncio.to_thread(locks.is_held, lock):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _refuse(send, gone):
    return await _error(send, 503, hosts.message(gone), "ServiceUnavailableError")


async def _error(send, status: int, message: str, kind: str, code: int | None = None):
    body = json.dumps({"error": {"message": message, "type": kind, "code": code or status}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})

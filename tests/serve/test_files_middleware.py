"""``serve``'s file routes and request guards (serve/files.py), called as vLLM's server calls an
ASGI middleware, over a real folder: bare names only, no symlink followed, a held lock never blocks
the event loop, bodies capped, deep JSON refused, a full disk answered 507, the API key asked.
(vLLM's server itself is in tests/engine/test_serve.py.)"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time

import pytest

from speculators_compat.serve.files import HiddenStatesFiles


async def _inner(scope, receive, send):
    """What vLLM's app would answer: 200 with the body it received."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"inner:" + body})


def call(mw, method, path, body=b"", headers=(), chunks=None):
    """(status, body) of one request through ``mw``."""
    sent = []
    parts = chunks if chunks is not None else [body]

    async def receive():
        chunk = parts.pop(0) if parts else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": path, "headers": [(k.encode(), v.encode()) for k, v in headers]}
    asyncio.run(mw(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def get(mw, path) -> int:
    """A GET through ``mw`` on the running loop; its status."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(msg):
        sent.append(msg)

    await mw({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)
    return sent[0]["status"]


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "hs"
    d.mkdir()
    (d / "a-1.safetensors").write_bytes(b"x" * 3_000_000)
    return d


def mw_for(folder, **kw):
    return HiddenStatesFiles(_inner, {"folder": str(folder), **kw})


def test_a_file_is_served_whole_and_deleted_with_its_lock(folder):
    mw = mw_for(folder)
    (folder / "a-1.safetensors.lock").write_bytes(b"")
    status, body = call(mw, "GET", "/a-1.safetensors")
    assert status == 200 and body == (folder / "a-1.safetensors").read_bytes()
    assert call(mw, "DELETE", "/a-1.safetensors")[0] == 204
    assert not os.listdir(folder)
    assert call(mw, "DELETE", "/a-1.safetensors")[0] == 404


@pytest.mark.parametrize(
    "name",
    [
        "link.safetensors",
        "a" * 5000 + ".safetensors",
        "..%2Fsecret.safetensors",
        ".hidden.safetensors",
        "dir.safetensors",
    ],
)
def test_only_regular_files_by_bare_name(folder, tmp_path, name):
    (tmp_path / "secret.safetensors").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.safetensors", folder / "link.safetensors")
    (folder / ".hidden.safetensors").write_bytes(b"hidden")
    (folder / "dir.safetensors").mkdir()
    status, body = call(mw_for(folder), "GET", "/" + name)
    assert status == 404 and b"secret" not in body and b"hidden" not in body
    assert call(mw_for(folder), "DELETE", "/" + name)[0] == 404
    assert (tmp_path / "secret.safetensors").exists()


def test_a_held_lock_never_blocks_the_event_loop(folder):
    """A client holds a file's lock: the GET for it waits without blocking, other requests are
    answered meanwhile, and the GET goes through once the lock is let go."""
    mw = mw_for(folder)
    fd = os.open(folder / "a-1.safetensors.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    answered = {}

    async def main():
        task = asyncio.create_task(get(mw, "/a-1.safetensors"))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await get(mw, "/health")
        answered["health_s"] = time.monotonic() - t0
        assert not task.done()
        os.close(fd)  # (the lock goes with it)
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 200
    assert answered["health_s"] < 0.5


def test_bodies_over_the_cap_are_413(folder):
    mw = mw_for(folder, max_body=1000)
    big = b"{" + b" " * 2000 + b"}"
    assert call(mw, "POST", "/v1/completions", big, [("content-length", str(len(big)))])[0] == 413
    # no length declared (chunked): counted as it comes
    assert call(mw, "POST", "/v1/completions", chunks=[b"{" + b" " * 600, b" " * 600 + b"}"])[0] == 413
    status, body = call(mw, "POST", "/v1/completions", b'{"a": 1}', [("content-type", "application/json")])
    assert status == 200 and body == b'inner:{"a": 1}'


def test_deeply_nested_json_is_400_and_arrays_of_ids_pass(folder):
    mw = mw_for(folder)
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, body = call(mw, "POST", "/v1/completions", deep, [("content-type", "application/json")])
    assert status == 400 and b"nested deeper" in body
    ids = json.dumps({"prompt": [[i] for i in range(3000)], "note": "[[[[" * 100}).encode()
    assert call(mw, "POST", "/v1/completions", ids, [("content-type", "application/json")])[0] == 200


def test_a_full_disk_is_507_naming_the_folder(folder):
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    mw = mw_for(folder, reserve=free * 2)
    status, body = call(mw, "POST", "/v1/completions", b"{}", [("content-type", "application/json")])
    err = json.loads(body)["error"]
    assert status == 507 and "no space left on" in err["message"] and str(folder) in err["message"]
    assert call(mw, "POST", "/v1/models-ish", b"{}")[0] == 200  # (only requests that may be captured)
    assert call(mw_for(folder, reserve=1), "POST", "/v1/completions", b"{}")[0] == 200


def test_the_api_key_guards_the_file_routes(folder):
    mw = mw_for(folder, tokens=["sekret"])
    assert call(mw, "GET", "/a-1.safetensors")[0] == 401
    assert call(mw, "GET", "/a-1.safetensors", headers=[("authorization", "Bearer wrong")])[0] == 401
    assert call(mw, "DELETE", "/a-1.safetensors")[0] == 401 and (folder / "a-1.safetensors").exists()
    assert call(mw, "GET", "/a-1.safetensors", headers=[("authorization", "Bearer sekret")])[0] == 200

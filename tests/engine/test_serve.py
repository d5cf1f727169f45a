"""``speculators-compat serve`` on the real engine, driven by speculators 0.9.0's own client
functions (``speculators/data_generation/vllm_client.py``, unchanged): concurrent requests get
files that are HF-right per sequence and layer (float32: testing/reference.py's 1e-3), chat
requests are rendered by the tokenizer's template as the client expects, bad requests are refused
with a 400 naming the problem while the server keeps serving, and SIGTERM lets the requests in
flight finish before the server exits, leaving nothing in /dev/shm.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from speculators_compat.testing import models, reference

pytestmark = pytest.mark.ends  # (the library's own server over the engine: newest cell)

RELEASE = Path(sys.prefix) / "speculators-releases" / "0.9.0"
LAYERS_VLLM = [2, 3, 4, 6]  # vLLM's ids (the output of k layers), as vllm serve's extractor takes them
PROMPTS = models.random_prompts([5, 300, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200, 3, 70, 44, 17], seed=12)
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def client_module():
    if not (RELEASE / "speculators" / "data_generation" / "vllm_client.py").is_file():
        pytest.fail(f"speculators 0.9.0 is not installed at {RELEASE}: build this env with scripts/engine_env.py")
    sys.path.insert(0, str(RELEASE))
    try:
        from speculators.data_generation import vllm_client
    finally:
        sys.path.remove(str(RELEASE))
    return vllm_client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body, timeout=120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def model_dir(llama_path, tmp_path_factory):
    """The tiny Llama with a chat template (its tokenizer has none)."""
    d = tmp_path_factory.mktemp("served-model") / "llama"
    shutil.copytree(llama_path, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    hs = tmp_path_factory.mktemp("served-hs")
    port = free_port()
    shm_before = set(_shm())
    log = open(hs.parent / "serve.log", "w")  # noqa: SIM115  (closed below)
    cmd = [sys.executable, "-m", "speculators_compat.cli", "serve", "--model", model_dir, "--hidden-states-path"]
    cmd += [str(hs), "--layer-ids", ",".join(map(str, LAYERS_VLLM)), "--dtype", "float32", "--port", str(port)]
    cmd += ["--max-model-len", "512", "--max-num-batched-tokens", "128", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("serve exited at start:\n" + Path(log.name).read_text()[-4000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("serve did not come up:\n" + Path(log.name).read_text()[-4000:])
    yield {"url": url, "proc": proc, "hs": hs, "log": log.name, "shm_before": shm_before}
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


def test_models_and_health(server):
    with urllib.request.urlopen(server["url"] + "/v1/models") as r:
        cards = json.loads(r.read())["data"]
    assert [c["id"] for c in cards] == ["tiny"] and cards[0]["max_model_len"] == 512
    with urllib.request.urlopen(server["url"] + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_concurrent_requests_from_speculators_client_are_hf_right(server, model_dir, hf_ref):
    import openai
    import torch
    from safetensors.torch import load_file

    vc = client_module()
    client = openai.Client(base_url=server["url"] + "/v1", api_key="none")

    def one(ids):
        path, params = vc.generate_hidden_states(client, "tiny", {"input_ids": ids})  # checks prompt_token_ids
        if os.path.exists(path + ".lock"):
            vc.wait_for_lock(path + ".lock")  # as generate-offline-data does
        return path, params

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, PROMPTS))
    files = [load_file(p) for p, _ in got]
    assert [f["token_ids"].tolist() for f in files] == PROMPTS
    assert all(set(f) == {"hidden_states", "token_ids"} for f in files)
    states = [[f["hidden_states"][:, j] for j in range(len(LAYERS_VLLM))] for f in files]
    assert files[0]["hidden_states"].dtype == torch.float32
    worst, bad = reference.compare(states, PROMPTS, hf_ref(model_dir, [k - 1 for k in LAYERS_VLLM]), 1e-3)
    assert not bad, (worst, bad[:3])
    assert len({p for p, _ in got}) == len(PROMPTS) and not list(server["hs"].glob("*.lock"))


def test_chat_requests_render_as_the_client_expects(server, model_dir):
    import openai
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    vc = client_module()
    client = openai.Client(base_url=server["url"] + "/v1", api_key="none")
    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "t5 t6 t7"}, {"role": "assistant", "content": "t8 t9"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    path, _ = vc.generate_hidden_states(client, "tiny", {"input_ids": ids, "messages": msgs})
    assert load_file(path)["token_ids"].tolist() == ids


@pytest.mark.parametrize(
    "body,message",
    [
        ({"model": "tiny", "prompt": [5, 6, 99999], "max_tokens": 1}, "token id 99999, outside the model's vocabulary"),
        ({"model": "tiny", "prompt": [5] * 600, "max_tokens": 1}, "the prompt has 600 tokens; at most"),
        ({"model": "tiny", "prompt": [5, 6], "max_tokens": 4}, "max_tokens must be 1"),
        ({"model": "other", "prompt": [5, 6]}, "the model `other` does not exist"),
        ({"model": "tiny", "prompt": [[1, 2], [3]]}, "one prompt a request"),
        ({"model": "tiny", "prompt": [5, -1]}, "negative token id -1"),
        (b"{not json", "not JSON"),
    ],
)
def test_a_bad_request_is_refused_and_the_server_keeps_serving(server, body, message):
    status, out = post(server["url"] + "/v1/completions", body)
    assert status == 400 and message in out["error"]["message"], out
    status, out = post(server["url"] + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})
    assert status == 200 and os.path.exists(out["kv_transfer_params"]["hidden_states_path"])


def test_sigterm_finishes_the_requests_in_flight_then_exits(server):
    """Last in this module: it stops the server."""
    proc, url = server["proc"], server["url"]
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 1, "return_token_ids": True}
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(post, url + "/v1/completions", body) for _ in range(6)]
        time.sleep(0.3)  # (the requests are in)
        proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futs]
    assert proc.wait(timeout=120) == 0, Path(server["log"]).read_text()[-3000:]
    assert all(s == 200 and r["choices"][0]["prompt_token_ids"] == PROMPTS[1] for s, r in results), results
    assert all(os.path.exists(r["kv_transfer_params"]["hidden_states_path"]) for _, r in results)
    assert set(_shm()) <= server["shm_before"]  # the server's hand-off arena went with it
    assert not list(server["hs"].glob(".*.partial"))


def _shm() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("speculators-compat-")]

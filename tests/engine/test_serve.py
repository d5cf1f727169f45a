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
from tests.helpers import RELEASES, from_release

pytestmark = pytest.mark.ends  # (the library's own server over the engine: newest cell)

RELEASE = RELEASES / "0.9.0"
LAYERS_VLLM = [2, 3, 4, 6]  # vLLM's ids (the output of k layers), as vllm serve's extractor takes them
PROMPTS = models.random_prompts([5, 300, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200, 3, 70, 44, 17], seed=12)
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def client_module():
    (vllm_client,) = from_release("0.9.0", "speculators.data_generation.vllm_client")
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


def start_server(model_dir: str, hs: Path, *extra: str) -> dict:
    port = free_port()
    log = open(hs.parent / f"serve-{hs.name}.log", "w")  # noqa: SIM115  (closed by stop_server)
    cmd = [sys.executable, "-m", "speculators_compat.cli", "serve", "--model", model_dir, "--hidden-states-path"]
    cmd += [str(hs), "--layer-ids", ",".join(map(str, LAYERS_VLLM)), "--dtype", "float32", "--port", str(port)]
    cmd += ["--max-model-len", "512", "--max-num-batched-tokens", "128", "--served-model-name", "tiny", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = {"url": f"http://127.0.0.1:{port}", "proc": proc, "hs": hs, "log": log}
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("serve exited at start:\n" + Path(log.name).read_text()[-4000:])
        try:
            with urllib.request.urlopen(srv["url"] + "/health", timeout=2) as r:
                if r.status == 200:
                    return srv
        except OSError:
            time.sleep(0.5)
    stop_server(srv)
    pytest.fail("serve did not come up:\n" + Path(log.name).read_text()[-4000:])


def stop_server(srv: dict) -> None:
    if srv["proc"].poll() is None:
        os.killpg(srv["proc"].pid, signal.SIGKILL)
        srv["proc"].wait()
    srv["log"].close()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_server(model_dir, tmp_path_factory.mktemp("served-hs"))
    yield srv
    stop_server(srv)


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


def test_files_over_http(server):
    """GET / DELETE of a file under --hidden-states-path (speculators' ``http`` hidden-states
    backend asks its ``scripts/serve_hs.py`` for these)."""
    status, out = post(server["url"] + "/v1/completions", {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 1})
    path = Path(out["kv_transfer_params"]["hidden_states_path"])
    with urllib.request.urlopen(f"{server['url']}/{path.name}") as r:
        assert r.read() == path.read_bytes()
    req = urllib.request.Request(f"{server['url']}/{path.name}", method="DELETE")
    with urllib.request.urlopen(req) as r:
        assert r.status == 204
    assert not path.exists() and not Path(f"{path}.lock").exists()
    for name in (path.name, "..%2Fserve.log", "health.safetensors"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{server['url']}/{name}")
        assert e.value.code == 404


def test_a_client_that_disconnects_leaves_no_file(server):
    before = set(os.listdir(server["hs"]))
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 1}).encode()
    host, port = server["url"].rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as s:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(3)  # (its capture runs to the end; then nobody is there to read a file)
    assert set(os.listdir(server["hs"])) == before
    status, _ = post(server["url"] + "/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 1})
    assert status == 200


@pytest.fixture
def prepared(tmp_path):
    """What speculators >= 0.5's prepare-data saves: input_ids, loss_mask, seq_len."""
    import datasets

    masks = [[0] * (len(p) // 3) + [1] * (len(p) - len(p) // 3) for p in PROMPTS]
    rows = {"input_ids": PROMPTS, "loss_mask": masks, "seq_len": [len(p) for p in PROMPTS]}
    datasets.Dataset.from_dict(rows).with_format("torch").save_to_disk(str(tmp_path / "prepared"))
    return tmp_path / "prepared"


def test_speculators_generate_offline_data_against_serve(server, prepared, model_dir, hf_ref, tmp_path):
    """speculators 0.9.0's own ``generate-offline-data --endpoint``, unchanged."""
    from safetensors.torch import load_file

    out = tmp_path / "hs"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(RELEASE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "speculators", "generate-offline-data", "--endpoint", server["url"] + "/v1"]
    cmd += ["--preprocessed-data", str(prepared), "--output", str(out), "--concurrency", "4"]
    cmd += ["--validate-outputs", "--fail-on-error"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    files = [load_file(out / f"hs_{i}.safetensors") for i in range(len(PROMPTS))]
    assert [f["token_ids"].tolist() for f in files] == PROMPTS
    states = [[f["hidden_states"][:, j] for j in range(len(LAYERS_VLLM))] for f in files]
    worst, bad = reference.compare(states, PROMPTS, hf_ref(model_dir, [k - 1 for k in LAYERS_VLLM]), 1e-3)
    assert not bad, (worst, bad[:3])


def test_speculators_trainer_on_missing_generate_against_serve(server, prepared, model_dir):
    """speculators 0.9.0's ArrowDataset with ``--on-missing generate`` (online training): every
    row generated through the server, read back, checked by its own ``check_hidden_states`` and
    deleted; its draft trains on them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(RELEASE), os.environ.get("PYTHONPATH", "")]))
    env["TORCHDYNAMO_DISABLE"] = "1"
    before = set(os.listdir(server["hs"]))
    script = Path(__file__).resolve().parents[1] / "clients" / "train_steps.py"
    cmd = [sys.executable, str(script), "--data", str(prepared), "--verifier", model_dir, "--format", "hs"]
    cmd += ["--target-layer-ids", "2,3,4", "--endpoint", server["url"] + "/v1"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    line = next((x for x in p.stdout.splitlines() if x.startswith("TRAIN ")), None)
    assert line is not None, (p.stdout + p.stderr)[-4000:]
    train = json.loads(line[6:])
    assert train["samples"] == len(PROMPTS) and train["unavailable"] == 0, train
    assert train["finite"] and train["losses"][-1] < train["losses"][0], train
    assert set(os.listdir(server["hs"])) == before  # (the trainer deleted every file it asked for)


def test_fp8_states_from_serve_read_by_speculators_fp8_reader(model_dir, hf_ref, tmp_path):
    """``serve --states-dtype fp8``: hs-connectors' FP8 layout, dequantized by its own FP8Transfer
    within fp8's bound of HF (float32's tolerance plus 2^-4)."""
    import openai
    import torch
    from safetensors.torch import load_file

    vc = client_module()
    (transfer,) = from_release("0.9.0", "hs_connectors.transfer")
    FP8Transfer = transfer.FP8Transfer  # noqa: N806
    srv = start_server(model_dir, tmp_path / "hs8", "--states-dtype", "fp8")
    try:
        client = openai.Client(base_url=srv["url"] + "/v1", api_key="none")
        reader = FP8Transfer(srv["hs"], dequantize_dtype=torch.float32)
        states = []
        for ids in PROMPTS[:6]:
            _, params = vc.generate_hidden_states(client, "tiny", {"input_ids": ids})
            raw = load_file(params["hidden_states_path"])
            assert raw["hidden_states"].dtype == torch.float8_e4m3fn
            assert raw["hidden_states_scales"].shape == (len(ids), 1, 1)
            got = reader.get_generated(params)
            states.append([got["hidden_states"][:, j] for j in range(len(LAYERS_VLLM))])
        ref = hf_ref(model_dir, [k - 1 for k in LAYERS_VLLM])
        worst, bad = reference.compare(states, PROMPTS[:6], ref, 1e-3 + 2**-4)
        assert not bad, (worst, bad[:3])
        _a_dead_engine_fails_every_request(srv)
    finally:
        stop_server(srv)


def _a_dead_engine_fails_every_request(srv: dict) -> None:
    """A worker killed: /health and every request answer 503, naming it; the server stays up."""
    import psutil

    for child in psutil.Process(srv["proc"].pid).children(recursive=True):
        child.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(srv["url"] + "/health", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 503 and "worker" in json.loads(e.read())["error"]["message"]
            break
        time.sleep(0.2)
    else:
        pytest.fail("/health still says ok with the engine's workers killed")
    status, out = post(srv["url"] + "/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 1})
    assert status == 503 and "the engine failed" in out["error"]["message"], out
    assert srv["proc"].poll() is None


def test_sigterm_finishes_the_requests_in_flight_then_exits(server):
    """Last in this module: it stops the server."""
    proc, url = server["proc"], server["url"]
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 1, "return_token_ids": True}
    shm = set(_shm())  # (the server's hand-off files among them: its lock, its arena)
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(post, url + "/v1/completions", body) for _ in range(6)]
        time.sleep(0.3)  # (the requests are in)
        proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futs]
    assert proc.wait(timeout=120) == 0, Path(server["log"].name).read_text()[-3000:]
    assert all(s == 200 and r["choices"][0]["prompt_token_ids"] == PROMPTS[1] for s, r in results), results
    assert all(os.path.exists(r["kv_transfer_params"]["hidden_states_path"]) for _, r in results)
    after = set(_shm())
    assert after < shm, (shm, after)  # the server's hand-off files went with it, and nothing came
    assert not list(server["hs"].glob(".*.partial"))


def _shm() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("speculators-compat-")]

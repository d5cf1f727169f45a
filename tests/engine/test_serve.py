"""``speculators-compat serve``: vLLM's own OpenAI server with the capture connector, driven by
speculators 0.9.0's own commands and client functions, unchanged, on a tiny chat model whose
byte-level tokenizer round-trips text (testing/models.py ``llama-chat``):

- its whole data pipeline against ONE server: ``regenerate-responses`` (chat generations, no file
  written), ``prepare-data --render-endpoint``, ``generate-offline-data --endpoint`` (every file
  HF-right per sequence and layer, float32: 1e-3) and a few training steps on the result;
- concurrent states calls, ``include_output_tokens`` over HTTP, online training's
  ``--on-missing generate``;
- the file routes and guards on the real server (symlink, long name, held lock, body cap, deep
  JSON), ``--api-key``, FP8 files, a full disk (507) and ``--tensor-parallel-size 2``.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.version import Version

from speculators_compat.testing import models, reference
from tests.helpers import RELEASES, from_release

pytestmark = pytest.mark.ends  # (vLLM's server with our connector: the newest cell)

RELEASE = RELEASES / "0.9.0"
LAYERS_VLLM = [2, 3, 4, 6]  # vLLM's ids (the output of k layers), distinct: the 0.9.0 trainer asks it
PROMPTS = models.random_prompts([5, 300, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200, 3, 70, 44, 17], 12, models.CHAT_VOCAB)
WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this".split()


def client_module():
    (vllm_client,) = from_release("0.9.0", "speculators.data_generation.vllm_client")
    return vllm_client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body=None, method=None, headers=None, timeout=120) -> tuple[int, bytes]:
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, body, **kw) -> tuple[int, dict]:
    status, raw = request(url, body, **kw)
    return status, json.loads(raw)


def start_server(model: str, hs: Path, *extra: str, layers=LAYERS_VLLM) -> dict:
    port = free_port()
    log = open(hs.parent / f"serve-{hs.name}.log", "w")  # noqa: SIM115  (closed by stop_server)
    cmd = [sys.executable, "-m", "speculators_compat.cli", "serve", "--model", model, "--hidden-states-path", str(hs)]
    cmd += ["--layer-ids", ",".join(map(str, layers)), "--dtype", "float32", "--port", str(port)]
    cmd += ["--max-model-len", "512", "--max-num-batched-tokens", "128", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = {"url": f"http://127.0.0.1:{port}", "proc": proc, "hs": hs, "log": log, "model": model}
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


def release_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(RELEASE), os.environ.get("PYTHONPATH", "")]))


def speculators(*args: str, timeout=600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "speculators", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=release_env(), timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


@pytest.fixture(scope="module")
def chat_model(vllm_version):
    if vllm_version < Version("0.18"):
        pytest.skip("serve runs vLLM's server with the connector: vLLM 0.18+")
    return str(models.build("llama-chat"))


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    srv = start_server(chat_model, tmp_path_factory.mktemp("served-hs"))
    yield srv
    stop_server(srv)


def check_files(paths, seqs, model, hf_ref, tol=1e-3):
    from safetensors.torch import load_file

    files = [load_file(p) for p in paths]
    assert [f["token_ids"].tolist() for f in files] == seqs
    states = [[f["hidden_states"][:, j] for j in range(len(LAYERS_VLLM))] for f in files]
    worst, bad = reference.compare(states, seqs, hf_ref(model, [k - 1 for k in LAYERS_VLLM]), tol)
    assert not bad, (worst, bad[:3])


def test_vllms_own_endpoints(server):
    with urllib.request.urlopen(server["url"] + "/v1/models") as r:
        cards = json.loads(r.read())["data"]
    assert [c["id"] for c in cards] == [server["model"]] and cards[0]["max_model_len"] == 512
    assert request(server["url"] + "/metrics")[0] == 200
    status, out = post(server["url"] + "/v1/completions", {"model": server["model"], "prompt": [5, 6, 99999]})
    assert status == 400 and "99999" in json.dumps(out)  # (vLLM's own check, its own words)


def test_speculators_pipeline_against_one_server(server, chat_model, hf_ref, tmp_path):
    """regenerate-responses -> prepare-data --render-endpoint -> generate-offline-data -> training."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    rng = random.Random(1)
    chats = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": " ".join(rng.sample(WORDS, 6))}]} for i in range(6)
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    before = set(os.listdir(server["hs"]))
    speculators("regenerate-responses", "--endpoint", server["url"] + "/v1/chat/completions", "--dataset",
                str(tmp_path / "chats.jsonl"), "--max-tokens", "40", "--concurrency", "4",
                "--outfile", str(tmp_path / "regen.jsonl"))  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(tok.decode(r["input_ids"]) == r["text"] for r in rows)
    assert set(os.listdir(server["hs"])) == before  # generations are not captured
    # the regenerated conversations, rendered by the server's chat template
    answers = {r["primary_id"]: r["text"].split("<|im_start|>assistant\n", 1)[1] for r in rows}
    convs = [{"id": c["id"], "conversations": [*c["messages"], {"role": "assistant", "content": answers[c["id"]]}]}
             for c in chats]  # fmt: skip
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    prepared = tmp_path / "prepared"
    speculators("prepare-data", "--model", chat_model, "--data", str(tmp_path / "conv.jsonl"), "--output",
                str(prepared), "--seq-length", "256", "--render-endpoint", server["url"],
                "--num-preprocessing-workers", "2")  # fmt: skip
    ds = datasets.load_from_disk(str(prepared))
    want = [list(tok.apply_chat_template(c["conversations"], tokenize=True)["input_ids"]) for c in convs]
    got = [list(map(int, x)) for x in ds["input_ids"]]
    assert sorted(got) == sorted(want)  # (prepare-data shuffles the rows)
    speculators("generate-offline-data", "--endpoint", server["url"] + "/v1", "--preprocessed-data", str(prepared),
                "--output", str(prepared / "hidden_states"), "--concurrency", "4", "--validate-outputs",
                "--fail-on-error")  # fmt: skip
    paths = [prepared / "hidden_states" / f"hs_{i}.safetensors" for i in range(6)]
    check_files(paths, got, chat_model, hf_ref)
    assert set(os.listdir(server["hs"])) == before  # (the client took its files and locks)
    train = run_train(["--data", str(prepared), "--verifier", chat_model, "--format", "hs"])
    assert train["samples"] == 6 and train["finite"], train


def run_train(args: list[str]) -> dict:
    env = dict(release_env(), TORCHDYNAMO_DISABLE="1")
    script = Path(__file__).resolve().parents[1] / "clients" / "train_steps.py"
    cmd = [sys.executable, str(script), *args, "--target-layer-ids", "2,3,4"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    line = next((x for x in p.stdout.splitlines() if x.startswith("TRAIN ")), None)
    assert line is not None, (p.stdout + p.stderr)[-4000:]
    return json.loads(line[6:])


def test_concurrent_states_calls_from_speculators_client_are_hf_right(server, hf_ref):
    import openai

    vc = client_module()
    client = openai.Client(base_url=server["url"] + "/v1", api_key="none")

    def one(ids):
        path, params = vc.generate_hidden_states(client, server["model"], {"input_ids": ids})
        vc.wait_for_lock(path + ".lock")  # as generate-offline-data does
        return path

    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(one, PROMPTS))
    assert len(set(paths)) == len(PROMPTS)
    check_files(paths, PROMPTS, server["model"], hf_ref)
    assert not list(server["hs"].glob("*.lock"))


def test_include_output_tokens_over_http(server, hf_ref):
    body = {"model": server["model"], "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}}  # fmt: skip
    status, out = post(server["url"] + "/v1/completions", body)
    assert status == 200, out
    gen = out["choices"][0]["token_ids"]
    assert len(gen) == 8
    path = out["kv_transfer_params"]["hidden_states_path"]
    client_module().wait_for_lock(path + ".lock")
    check_files([path], [PROMPTS[2] + gen[:-1]], server["model"], hf_ref)


def test_files_over_http_bare_names_and_no_symlinks(server, tmp_path):
    status, out = post(
        server["url"] + "/v1/completions", {"model": server["model"], "prompt": PROMPTS[3], "max_tokens": 1}
    )
    path = Path(out["kv_transfer_params"]["hidden_states_path"])
    client_module().wait_for_lock(f"{path}.lock")
    status, raw = request(f"{server['url']}/{path.name}")
    assert status == 200 and raw == path.read_bytes()
    assert request(f"{server['url']}/{path.name}", method="DELETE")[0] == 204 and not path.exists()
    (tmp_path / "secret").write_text("secret")
    os.symlink(tmp_path / "secret", server["hs"] / "x.safetensors")
    try:
        for name in ("x.safetensors", "a" * 5000 + ".safetensors", "..%2Fsecret.safetensors", path.name):
            status, raw = request(f"{server['url']}/{name}")
            assert status == 404 and b"secret" not in raw, (name, status)
    finally:
        os.unlink(server["hs"] / "x.safetensors")


def test_guards_on_the_real_server(server):
    url = server["url"]
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:  # (a 40 MiB body declared, 1 KiB sent)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b"Content-Length: %d\r\n\r\n" % (40 << 20) + b"{" * 1024)
        assert s.recv(4096).split(b"\r\n", 1)[0].endswith(b"413 Request Entity Too Large")
    deep = b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, raw = request(url + "/v1/completions", deep)
    assert status == 400 and b"nested deeper" in raw
    # a client holding a file's lock: the GET for it waits, /health answers meanwhile
    name = "held.safetensors"
    (server["hs"] / name).write_bytes(b"x")
    fd = os.open(server["hs"] / (name + ".lock"), os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    got = {}
    t = threading.Thread(target=lambda: got.update(file=request(f"{url}/{name}")))
    t.start()
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        assert request(url + "/health", timeout=5)[0] == 200
        assert time.monotonic() - t0 < 2 and t.is_alive()
    finally:
        os.close(fd)
    t.join(30)
    assert got["file"] == (200, b"x")
    for p in (server["hs"] / name, server["hs"] / (name + ".lock")):
        p.unlink()


def test_speculators_trainer_on_missing_generate_against_serve(server, tmp_path):
    """speculators 0.9.0's ArrowDataset with ``--on-missing generate`` (online training): every
    row generated through the server, read back, checked and deleted; its draft trains on them."""
    import datasets

    masks = [[0] * (len(p) // 3) + [1] * (len(p) - len(p) // 3) for p in PROMPTS]
    rows = {"input_ids": PROMPTS, "loss_mask": masks, "seq_len": [len(p) for p in PROMPTS]}
    datasets.Dataset.from_dict(rows).with_format("torch").save_to_disk(str(tmp_path / "prepared"))
    before = set(os.listdir(server["hs"]))
    train = run_train(["--data", str(tmp_path / "prepared"), "--verifier", server["model"], "--format", "hs",
                       "--endpoint", server["url"] + "/v1"])  # fmt: skip
    assert train["samples"] == len(PROMPTS) and train["unavailable"] == 0, train
    assert train["finite"] and train["losses"][-1] < train["losses"][0], train
    assert set(os.listdir(server["hs"])) == before  # (the trainer deleted every file it asked for)


def test_plain_vllm_serve_with_the_connector_alone(chat_model, hf_ref, tmp_path):
    """docs/serving.md's recipe, verbatim: ``vllm serve`` with the connector and no speculative
    config serves speculators 0.9.0's ``generate-offline-data``."""
    import datasets

    hs, port = tmp_path / "hs", free_port()
    kv = {"kv_connector": "CaptureConnector", "kv_connector_module_path": "speculators_compat.connector",
          "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(hs), "layer_ids": LAYERS_VLLM}}  # fmt: skip
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", chat_model, "--port", str(port),
           "--enforce-eager", "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(kv),
           "--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "128"]  # fmt: skip
    log = open(tmp_path / "vllm.log", "w")  # noqa: SIM115  (closed by stop_server)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = {"proc": proc, "log": log}
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while not _up(url):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "vllm.log").read_text()[-3000:]
            time.sleep(0.5)
        rows = {"input_ids": PROMPTS[:6], "loss_mask": [[1] * len(p) for p in PROMPTS[:6]]}
        rows["seq_len"] = [len(p) for p in PROMPTS[:6]]
        datasets.Dataset.from_dict(rows).with_format("torch").save_to_disk(str(tmp_path / "prepared"))
        out = tmp_path / "prepared" / "hidden_states"
        speculators("generate-offline-data", "--endpoint", url + "/v1", "--preprocessed-data",
                    str(tmp_path / "prepared"), "--output", str(out), "--fail-on-error")  # fmt: skip
        check_files([out / f"hs_{i}.safetensors" for i in range(6)], PROMPTS[:6], chat_model, hf_ref)
    finally:
        stop_server(srv)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def test_fp8_api_key_and_a_full_disk(chat_model, hf_ref, small_disk):
    """``--states-dtype fp8`` files read by hs-connectors' FP8Transfer within fp8's bound of HF;
    ``--api-key`` guards vLLM's API and our file routes; a disk with less room than a request needs
    answers 507 naming it, and serves again once room is made."""
    import openai
    import torch
    from safetensors.torch import load_file

    (transfer,) = from_release("0.9.0", "hs_connectors.transfer")
    disk = small_disk("4m")
    srv = start_server(chat_model, disk / "hs", "--states-dtype", "fp8", "--api-key", "k3y")
    try:
        auth = {"Authorization": "Bearer k3y"}
        assert request(srv["url"] + "/v1/models")[0] == 401
        client = openai.Client(base_url=srv["url"] + "/v1", api_key="k3y")
        reader = transfer.FP8Transfer(srv["hs"], dequantize_dtype=torch.float32)
        vc, states = client_module(), []
        for ids in PROMPTS[:4]:
            path, params = vc.generate_hidden_states(client, chat_model, {"input_ids": ids})
            vc.wait_for_lock(path + ".lock")
            raw = load_file(path)
            assert raw["hidden_states"].dtype == torch.float8_e4m3fn
            name = os.path.basename(params["hidden_states_path"])
            assert request(f"{srv['url']}/{name}")[0] == 401
            assert request(f"{srv['url']}/{name}", headers=auth)[0] == 200
            got = reader.get_generated(params)
            states.append([got["hidden_states"][:, j] for j in range(len(LAYERS_VLLM))])
        ref = hf_ref(chat_model, [k - 1 for k in LAYERS_VLLM])
        worst, bad = reference.compare(states, PROMPTS[:4], ref, 1e-3 + 2**-4)
        assert not bad, (worst, bad[:3])
        filler = disk / "filler"
        free = shutil.disk_usage(disk).free
        filler.write_bytes(b"\0" * (free - (256 << 10)))
        body = {"model": chat_model, "prompt": PROMPTS[0], "max_tokens": 1}
        status, out = post(srv["url"] + "/v1/completions", body, headers=auth)
        assert status == 507 and f"no space left on {srv['hs']}" in out["error"]["message"], out
        filler.unlink()
        assert post(srv["url"] + "/v1/completions", body, headers=auth)[0] == 200
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_tensor_parallel_2(chat_model, hf_ref, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # (vLLM's CPU workers: one core each)
    srv = start_server(chat_model, tmp_path / "hs", "--tensor-parallel-size", "2")
    try:
        vc = client_module()
        import openai

        client = openai.Client(base_url=srv["url"] + "/v1", api_key="none")
        paths = []
        for ids in PROMPTS[:6]:
            path, _ = vc.generate_hidden_states(client, chat_model, {"input_ids": ids})
            vc.wait_for_lock(path + ".lock")
            paths.append(path)
        check_files(paths, PROMPTS[:6], chat_model, hf_ref)
    finally:
        stop_server(srv)

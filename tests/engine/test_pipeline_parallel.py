"""Pipeline parallelism on real CPU vLLM (0.32+; one core per worker, float32, tolerance 1e-3): each
stage's first TP rank captures the layers its stage computes, the last stage runs the self-check,
and the driver puts every request's rows together in the caller's layer order. Rows against HF per
request and layer, input order, chunked prefill (64-token steps), reversed and repeated calls; a
second host through vLLM's multiprocessing executor over nodes, its worker handing rows back over
RPC; the patched upstream class; ``extract`` at PP=2 byte for byte against PP=1."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from speculators_compat import VllmHiddenStatesGenerator
from speculators_compat.engine.fp8 import quantize_rows
from speculators_compat.layers import stage_ranges
from speculators_compat.testing import models, reference
from tests.helpers import check_generate

TOL = reference.TOLERANCE["float32"]
LAYERS = [5, 1, 3]  # unsorted, over both stages of the 6-layer model: results follow this order
PROMPTS = models.random_prompts([5, 400, 37, 700, 12, 90, 8, 50, 99, 10, 11, 3, 150], seed=41)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_cpu_pp(vllm_version):
    if vllm_version < Version("0.32"):
        pytest.skip(f"vLLM {vllm_version}: pipeline parallelism is tested on the newest cell (0.32+)")


def pp_generator(path: str, **kw) -> VllmHiddenStatesGenerator:
    """The tiny model at PP=2, float32, LAYERS, self-check on; ``kw`` adds or overrides."""
    return VllmHiddenStatesGenerator(
        path,
        **{
            "layer_ids": LAYERS,
            "max_model_len": 1024,
            "dtype": "float32",
            "pipeline_parallel_size": 2,
            "self_check": True,
            **kw,
        },
    )


def _stages(gen) -> list:
    return [(s["stage"], s["layers"], s["handoff"]) for s in gen.engine.model_info["stages"]]


def test_pp2_every_row_against_hf(llama_path, hf_ref, monkeypatch):
    """PP=2: stage 0 captures layer 1, stage 1 layers 5 and 3 and checks every request's token; as vLLM
    splits the layers (layers.stage_ranges); every row HF-right in input order over chunked prefill,
    reversed and repeated calls; a capture shifted on the last stage fails the self-check there."""
    from speculators_compat.errors import CaptureError

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with pp_generator(llama_path, max_num_batched_tokens=64) as g:
        assert stage_ranges(6, 2) == [(0, 3), (3, 6)]
        assert [tuple(s["range"]) for s in g.engine.model_info["stages"]] == stage_ranges(6, 2)  # vLLM's split
        assert _stages(g) == [(0, [1], "shm"), (1, [5, 3], "shm")]
        check_generate(g, llama_path, PROMPTS, hf_ref, LAYERS, TOL)
        check_generate(g, llama_path, PROMPTS[::-1], hf_ref, LAYERS, TOL)
        check_generate(g, llama_path, PROMPTS[:4], hf_ref, LAYERS, TOL)
        assert g.engine.self_check_stats.as_dict()["checked"] == 2 * len(PROMPTS) + 4
        g.engine.executor.collective_rpc("compat_inject_fault", args=("swap",))
        try:
            with pytest.raises(CaptureError, match="self-check"):
                g.generate(models.random_prompts([30] * 6, seed=43))
        finally:
            g.engine.executor.collective_rpc("compat_inject_fault", args=(None,))
        check_generate(g, llama_path, PROMPTS[:5], hf_ref, LAYERS, TOL)


def test_pp2_fp8_is_the_quantization_of_the_unquantized_states(llama_path, hf_ref, monkeypatch):
    """FP8 at PP=2: a token's scale spans layers on both stages, so the driver quantizes (fp8.py's
    arithmetic): bit for bit quantize_rows of the same engine's unquantized states (read back from
    a PP=2 run without FP8 through the same prompts), within the FP8 bound of HF."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    kw = dict(
        layer_ids=LAYERS, max_model_len=1024, dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=64
    )
    prompts = PROMPTS[:6]
    with VllmHiddenStatesGenerator(llama_path, **kw) as g:
        plain = [r["hidden_states"] for r in g.generate(prompts)]
    with VllmHiddenStatesGenerator(llama_path, states_dtype="fp8", **kw) as g:
        res = g.generate(prompts)
    for r, layers in zip(res, plain):
        q, scales = quantize_rows(layers)
        assert torch.equal(r["hidden_states_scales"], scales[:, None])
        for got, want in zip(r["hidden_states"], q):
            assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.slow
def test_tp2_pp2_every_row_against_hf(llama_path, hf_ref, monkeypatch):
    """TP=2 x PP=2: four workers (two a core), each stage's TP rank 0 capturing; the self-check's
    logits gathered over the last stage's TP group."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0|1")
    with pp_generator(llama_path, tensor_parallel_size=2, max_num_batched_tokens=128) as g:
        assert _stages(g) == [(0, [1], "shm"), (1, [5, 3], "shm")]
        check_generate(g, llama_path, PROMPTS, hf_ref, LAYERS, TOL)
        check_generate(g, llama_path, PROMPTS[::-1], hf_ref, LAYERS, TOL)
        assert g.engine.self_check_stats.as_dict()["checked"] == 2 * len(PROMPTS)


@pytest.mark.slow
def test_deepseek_v3_pp2(hf_ref, monkeypatch):
    """The DeepSeek-V3 (Kimi-K2) architecture at PP=2: its dense first layer and MoE layers on two
    stages. CPU MLA differs from HF past position 0 (test_dropin_engines.DEEPSEEK_CPU_NOTE), so each
    request's position-0 row, in every layer, against HF; and the whole rows against PP=1's."""
    from tests.engine.test_dropin_engines import check_position_zero

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    path = str(models.build("deepseek_v3"))
    layers = [3, 0, 1]
    prompts = models.random_prompts([5, 300, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200], seed=33)
    kw = dict(layer_ids=layers, max_model_len=1024, dtype="float32", max_num_batched_tokens=128, max_num_seqs=4)
    with VllmHiddenStatesGenerator(path, pipeline_parallel_size=2, **kw) as g:
        assert [lids for _, lids, _ in _stages(g)] == [[0, 1], [3]]
        res = g.generate(prompts)
    check_position_zero(res, prompts, hf_ref(path, layers))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with VllmHiddenStatesGenerator(path, **kw) as g:
        one = g.generate(prompts)
    for a, b in zip(res, one):
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert float((x - y).norm() / y.norm()) < TOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_second_host_hands_rows_back_over_rpc(llama_path, hf_ref, monkeypatch):
    """One engine over two hosts (vLLM's multiprocessing executor over nodes): this process is node 0
    (the driver, stage 0), ``speculators-compat node --node-rank 1`` is node 1 (stage 1), both on this
    machine. Node 1 is started with ``SPECULATORS_COMPAT_HANDOFF=rpc``, as a host without the driver's
    /dev/shm acts: its rows come back in its RPC replies, stage 0's through /dev/shm, put together
    HF-right; node 1 exits when the driver's engine shuts down."""
    port = _free_port()
    common = [
        "--model",
        llama_path,
        "--pipeline-parallel-size",
        "2",
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
        "--max-num-batched-tokens",
        "64",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    env = dict(os.environ, SPECULATORS_COMPAT_HANDOFF="rpc", VLLM_CPU_OMP_THREADS_BIND="1", PYTHONPATH=str(ROOT))
    node = subprocess.Popen(
        [sys.executable, "-m", "speculators_compat.cli", "node", *common, "--node-rank", "1"], env=env
    )
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    try:
        with pp_generator(
            llama_path, max_num_batched_tokens=64, nnodes=2, master_addr="127.0.0.1", master_port=port
        ) as g:
            assert _stages(g) == [(0, [1], "shm"), (1, [5, 3], "rpc")]
            check_generate(g, llama_path, PROMPTS, hf_ref, LAYERS, TOL)
            check_generate(g, llama_path, PROMPTS[::-1], hf_ref, LAYERS, TOL)
            assert g.engine.self_check_stats.as_dict()["checked"] == 2 * len(PROMPTS)
        assert node.wait(timeout=120) is not None
    finally:
        if node.poll() is None:
            node.kill()


def test_extract_at_pp2_is_byte_identical_to_pp1(llama_path, tmp_path, monkeypatch):
    """``extract --pipeline-parallel-size 2`` writes the same bytes as a PP=1 run (each layer runs
    the same CPU kernels on the same rows at either size), manifest included, and ``plan`` names
    which stage captures which layers."""
    from tests.helpers import make_jsonl, read_dir

    make_jsonl(tmp_path / "in.jsonl", lengths=[5, 300, 37, 700, 12, 90, 8, 50, 99, 10, 11, 3, 150], seed=5)
    cli = [sys.executable, "-m", "speculators_compat.cli"]
    args = ["--model", llama_path, "--layer-ids", "5,1,3", "--dtype", "float32", "--max-model-len", "1024"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=str(ROOT))
    plan = subprocess.run(
        [*cli, "plan", *args, "--pipeline-parallel-size", "2"], capture_output=True, text=True, env=env
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert (
        "stage 0: layers 0..2, captures [1]" in plan.stdout and "stage 1: layers 3..5, captures [5, 3]" in plan.stdout
    )
    run = [
        *cli,
        "extract",
        *args,
        "--input",
        str(tmp_path / "in.jsonl"),
        "--batch-size",
        "4",
        "--max-num-batched-tokens",
        "128",
        "--no-progress",
    ]
    for pp, bind in ((1, "0"), (2, "0|1")):
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        r = subprocess.run(
            [*run, "--output", str(tmp_path / f"pp{pp}"), "--pipeline-parallel-size", str(pp)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    one, two = read_dir(tmp_path / "pp1"), read_dir(tmp_path / "pp2")
    assert len(one) == 14 and one == two


UPSTREAM_PP2 = r"""
import speculators_compat  # the user's one-line change
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
from speculators_compat.testing import models, reference
path = str(models.build("llama"))
prompts = models.random_prompts([5, 300, 37, 700, 12, 90, 8, 50, 99, 10, 11, 3], seed=9)
gen = VllmHiddenStatesGenerator(path, layer_ids=[1, 3, 5], max_model_len=1024, pipeline_parallel_size=2)
stages = gen._compat_engine.model_info["stages"]
res = gen.generate(prompts)
gen.__del__()
worst, bad = reference.compare([r["hidden_states"] for r in res], prompts, reference.HFReference(path, [1, 3, 5]),
                               reference.TOLERANCE["bfloat16"])
order = [r["input_ids"].tolist() for r in res] == prompts
emit({"stages": [s["layers"] for s in stages], "worst": worst, "bad": len(bad), "order": order})
"""


def test_upstream_class_at_pp2():
    """speculators 0.3.0's own class, patched, with ``pipeline_parallel_size=2`` (ours: upstream has
    none): upstream's settings (bf16 on CPU, its tolerance), every row HF-right in input order."""
    from tests.helpers import run_snippet

    out, log = run_snippet(UPSTREAM_PP2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout=600)
    assert out is not None, log[-3000:]
    assert out["stages"] == [[1], [3, 5]] and out["order"] and out["bad"] == 0, out


@dataclass
class _TwoHosts:
    """``extract`` over two hosts on this machine (``node`` 1 in its own session), four or more
    files already written: what the fault tests act on."""

    node: subprocess.Popen
    driver: subprocess.Popen
    run: list  # the extract command without its hosts and output
    out: Path
    env: dict

    def end(self) -> None:
        if self.driver.poll() is None:
            self.driver.kill()
        with contextlib.suppress(ProcessLookupError):  # (all of them gone already)
            os.killpg(self.node.pid, signal.SIGKILL)  # the node's command and its workers
        self.node.wait()


def _two_hosts_writing(llama_path: str, tmp_path: Path, seed: int, *more: str) -> _TwoHosts:
    from tests.helpers import make_jsonl

    make_jsonl(tmp_path / "in.jsonl", lengths=[300, 500, 400, 600] * 15, seed=seed)
    model = ["--model", llama_path, "--dtype", "float32", "--max-model-len", "1024", "--max-num-batched-tokens", "128"]
    hosts = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    hosts += ["--master-port", str(_free_port()), *more]
    cli = [sys.executable, "-m", "speculators_compat.cli"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=str(ROOT))
    node = subprocess.Popen(
        [*cli, "node", *model, *hosts, "--node-rank", "1"],
        env=dict(env, SPECULATORS_COMPAT_HANDOFF="rpc", VLLM_CPU_OMP_THREADS_BIND="1"),
        start_new_session=True,
    )
    out = tmp_path / "out"
    run = [*cli, "extract", *model, "--layer-ids", "5,1,3", "--input", str(tmp_path / "in.jsonl"), "--batch-size", "2"]
    driver = subprocess.Popen(
        [*run, *hosts, "--output", str(out), "--no-progress"],
        env=dict(env, VLLM_CPU_OMP_THREADS_BIND="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    hosts_ = _TwoHosts(node, driver, run, out, env)
    deadline = time.time() + 400
    while len(list(out.glob("data_*.pt"))) < 4 and driver.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if driver.poll() is not None or len(list(out.glob("data_*.pt"))) < 4:
        hosts_.end()
        pytest.fail("no files written over two hosts: " + driver.communicate()[0][-3000:])
    return hosts_


@pytest.mark.slow
def test_a_lost_host_stops_extract_naming_it_and_the_rerun_resumes(llama_path, tmp_path):
    """``extract`` over two hosts (both on this machine); ``node`` 1 killed with SIGKILL mid-run
    (its workers die with it: vLLM's workers end when their parent does). The driver notices
    through the hosts' liveness connection, stops its engine and exits non-zero within 150 s, its
    last words naming the lost host; the files written are whole, and a rerun on one host completes
    the dataset (the same bytes as a run that was never interrupted, at PP=1)."""
    from tests.helpers import read_dir

    h = _two_hosts_writing(llama_path, tmp_path, 6)
    try:
        os.killpg(h.node.pid, signal.SIGKILL)  # the host goes: its command and its workers
        t = time.time()
        try:
            log, _ = h.driver.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            h.driver.kill()
            pytest.fail(
                "the driver did not exit within 150 s of losing its second host: " + h.driver.communicate()[0][-3000:]
            )
        assert h.driver.returncode != 0
        last = log.rstrip().splitlines()[-1]
        assert "lost node 1 (127.0.0.1)" in last and "rerun to resume" in last, log[-3000:]
        print(f"driver stopped {time.time() - t:.1f} s after the host was lost: {last}")
    finally:
        h.end()
    h.env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    for d in (h.out, tmp_path / "ref"):
        r = subprocess.run([*h.run, "--output", str(d), "--no-progress"], capture_output=True, text=True, env=h.env)
        assert r.returncode == 0, r.stderr[-3000:]
    assert read_dir(h.out) == read_dir(tmp_path / "ref")


@pytest.mark.slow
def test_sigterm_ends_a_driver_blocked_on_a_frozen_host(llama_path, tmp_path):
    """``extract`` over two hosts whose second host freezes (``node`` and its workers stopped with
    SIGSTOP: the connection stays open, nothing answers) while the liveness watch is told to wait
    300 s. The driver is then blocked on that host; SIGTERM ends it within 30 s, non-zero, its last
    line saying the files written are complete and how to resume."""
    h = _two_hosts_writing(llama_path, tmp_path, 7, "--liveness-timeout", "300")
    try:
        os.killpg(h.node.pid, signal.SIGSTOP)  # the host freezes: its command and its workers
        time.sleep(5)
        assert h.driver.poll() is None, "the driver did not wait on the frozen host"
        h.driver.send_signal(signal.SIGTERM)
        t = time.time()
        try:
            log, _ = h.driver.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            h.driver.kill()
            pytest.fail("SIGTERM did not end the driver within 60 s: " + h.driver.communicate()[0][-3000:])
        took = time.time() - t
        assert took < 30, took
        assert h.driver.returncode == 128 + signal.SIGTERM, log[-3000:]
        last = log.rstrip().splitlines()[-1]
        assert "SIGTERM" in last and "run the same command again to resume" in last, log[-3000:]
        print(f"driver ended {took:.1f} s after SIGTERM: {last}")
    finally:
        h.end()

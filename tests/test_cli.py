"""The command line: doctor (no engine needed), plan, and argument errors."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env=None):
    import os

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "speculators_compat.cli", *args], capture_output=True, text=True,
                          env=e, cwd=ROOT)


def test_doctor_text_and_json():
    r = cli("doctor")
    assert r.returncode == 0, r.stderr
    for name in ("speculators_generator", "vllm_request", "transformers_config_torch"):
        assert name in r.stdout
    assert "vLLM tested range" in r.stdout
    j = json.loads(cli("doctor", "--json").stdout)
    assert j["enabled"] is True and {p["name"] for p in j["patches"]} >= {"speculators_generator", "vllm_request"}


def test_doctor_when_disabled():
    r = cli("doctor", env={"SPECULATORS_COMPAT_DISABLE": "1"})
    assert r.returncode == 0 and "DISABLED by SPECULATORS_COMPAT_DISABLE" in r.stdout


def test_plan_kimi_k25_on_8_gpus():
    r = cli("plan", "--model", "examples/kimi_k25", "--tensor-parallel-size", "8", "--gpu-memory-gib", "141",
            "--max-num-batched-tokens", "8192", "--num-samples", "100000", "--avg-tokens", "4096", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    # published: ~1.03T parameters, INT4 checkpoint ~595 GB; 7168 x 4 layers x 2 B = 57,344 B/token
    assert 1.00e12 < p["params_total"] < 1.06e12
    assert 585e9 < p["weight_bytes_total"] < 605e9
    assert p["hidden_bytes_per_token"] == 57344 and p["layer_ids"] == [2, 30, 58, 60]
    assert p["disk_bytes_per_token"] == 57344 + 16  # + int64 input_ids and loss_mask
    assert p["kv_bytes_per_token_per_gpu"] == (512 + 64) * 61 * 2  # MLA latent, replicated per rank
    assert p["weight_bytes_per_gpu"] < 141 * 2**30 * 0.8
    assert abs(p["dataset"]["hidden_state_bytes"] - 100000 * 4096 * 57344) < 1


def test_bad_cli_arguments():
    r = cli("extract", "--model", "x", "--input", "y", "--output", "z", "--layer-ids", "1,a")
    assert r.returncode != 0 and "--layer-ids must be comma-separated integers" in r.stderr
    r = cli("plan", "--model", "/nonexistent/model")
    assert r.returncode != 0 and "config.json not found" in r.stderr

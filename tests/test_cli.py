"""The command line: doctor (no engine needed), plan, and argument errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env=None):
    import os

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "speculators_compat.cli", *args], capture_output=True, text=True, env=e, cwd=ROOT
    )


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
    r = cli(
        "plan",
        "--model",
        "examples/kimi_k25",
        "--tensor-parallel-size",
        "8",
        "--gpu-memory-gib",
        "141",
        "--max-num-batched-tokens",
        "8192",
        "--num-samples",
        "100000",
        "--avg-tokens",
        "4096",
        "--json",
    )
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
    # the host hand-off: the pipeline's queue_size + 2 slabs, 1.25 x a batch of 8 prompts of
    # max_model_len - 1 tokens (no dataset read)
    assert p["handoff_batch_tokens"] == 8 * 2047
    assert p["handoff_bytes"] == int(4 * 1.25 * 8 * 2047 * 57344)
    # the MoonViT is in the checkpoint (and the per-GPU figure) but not loaded on vLLM 0.17+
    assert [n for n in p["notes"] if n.startswith("vision tower: 0.77 GiB") and "language_model_only" in n]


def test_plan_of_a_text_model_has_no_vision_note(tmp_path):
    cfg = json.loads((ROOT / "examples" / "kimi_k25" / "config.json").read_text())["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, architectures=["DeepseekV3ForCausalLM"])))
    r = cli("plan", "--model", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    assert not [n for n in json.loads(r.stdout)["notes"] if "vision" in n]


def test_plan_sizes_the_host_handoff_from_the_largest_batch(tmp_path):
    lengths = [10, 3000, 20, 30, 40, 50, 5]  # batches of 3: 3030 (3000 capped at 2047: 2077), 120, 5
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in lengths))
    r = cli(
        "plan",
        "--model",
        "examples/kimi_k25",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--batch-size",
        "3",
        "--queue-size",
        "1",
        "--max-model-len",
        "2048",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["handoff_batch_tokens"] == 10 + 2047 + 20
    assert p["handoff_bytes"] == int(3 * 1.25 * (10 + 2047 + 20) * 57344)
    text = cli("plan", "--model", "examples/kimi_k25", "--batch-size", "16").stdout
    assert "host hand-off (/dev/shm" in text and "largest batch 32,752 tokens" in text


def test_bad_cli_arguments():
    r = cli("extract", "--model", "x", "--input", "y", "--output", "z", "--layer-ids", "1,a")
    assert r.returncode != 0 and "--layer-ids must be comma-separated integers" in r.stderr
    r = cli("extract", "--model", "x", "--input", "y", "--output", "z", "--shard-size", "0")
    assert r.returncode != 0 and "--shard-size: expected an integer >= 1, not '0'" in r.stderr
    r = cli("extract", "--model", "x", "--input", "y", "--output", "z", "--shard-size", "4")  # default: pt
    assert r.returncode == 2 and "--shard-size 4 needs --format safetensors" in r.stderr
    for flag, value, least in [
        ("--max-model-len", "1", 2),
        ("--tensor-parallel-size", "0", 1),
        ("--max-num-seqs", "0", 1),
        ("--max-num-batched-tokens", "-5", 1),
        ("--batch-size", "0", 1),
        ("--queue-size", "0", 1),
        ("--max-samples", "-1", 0),
    ]:
        r = cli("extract", "--model", "x", "--input", "y", "--output", "z", flag, value)
        assert r.returncode == 2 and f"{flag}: expected an integer >= {least}, not '{value}'" in r.stderr, r.stderr
    for value in ("0", "1.5", "x"):
        r = cli("extract", "--model", "x", "--input", "y", "--output", "z", "--gpu-memory-utilization", value)
        assert r.returncode == 2 and f"expected a fraction in (0, 1], not '{value}'" in r.stderr
    r = cli("plan", "--model", "/nonexistent/model")
    assert r.returncode != 0 and "config.json not found" in r.stderr


@pytest.mark.parametrize(
    "installed, says",
    [
        (None, "not installed"),
        ("0.2.1", "not supported"),
        ("0.3.0", "(patch speculators_generator)"),
        ("0.4.0.1", "(patch speculators04_generator)"),
        ("0.4.0", "(patch speculators04_generator)"),
        ("0.3.5", "no patch declares this release"),
        ("0.9.0", "extract --format speculators-hs"),
        ("0.5.0rc1.dev3+gabc", "has no generator"),
    ],
)
def test_doctor_says_what_applies_to_the_installed_speculators(installed, says):
    from speculators_compat.report import speculators_path

    assert says in speculators_path(installed)


@pytest.mark.parametrize(
    "how",
    [
        ("plan", "--layer-ids", "1,61", "--layer-id-convention", "eagle3"),
        ("extract", "--format", "speculators-hs", "--layer-ids", "1,61", "--dry-run"),
        ("plan", "--layer-ids", "0,60"),
    ],
)
def test_plan_and_dry_run_resolve_layer_ids_as_extract_does(tmp_path, how):
    """One rule (layers.resolve) for extract, plan and --dry-run: the eagle3 convention (the last
    layer is id n) and --format speculators-hs's default convention. Kimi-K2.5 has 61 layers."""
    cmd, *rest = how
    if cmd == "extract":  # (--dry-run prints the plan as text)
        (tmp_path / "x.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
        r = cli(cmd, "--model", "examples/kimi_k25", *rest, "--input", str(tmp_path / "x.jsonl"), "--output", "o")
        assert r.returncode == 0, r.stderr
        assert "capture layer ids [0, 60]" in r.stdout  # (upstream's convention, which the files use)
        return
    r = cli(cmd, "--model", "examples/kimi_k25", *rest, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layer_ids"] == [0, 60]


def test_dry_run_of_speculators_hs_takes_its_default_layers():
    from speculators_compat.layers import resolve

    assert resolve(None, 61, None, "speculators-hs") == [1, 29, 57, 60]  # speculators >= 0.5's [2, 30, 58, 61]
    assert resolve(None, 61, None, "pt") == [2, 30, 58, 60]  # upstream's
    assert resolve(None, 4, None, "speculators-hs") == [1, 1, 0, 3]  # (a tiny model repeats one, as speculators does)

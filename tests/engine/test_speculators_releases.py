"""speculators releases beyond 0.3.0 on the real engine, and the real clients of what we write.

* 0.4.x's own ``VllmHiddenStatesGenerator``: what it does unpatched on this vLLM (measured per
  version below) and, after ``import speculators_compat``, the same contract right: input order,
  states HF-exact per sequence and layer, over chunked prefill and repeated calls.
* its offline script (tests/clients/offline_script.py: the same library calls; the script ships in
  no wheel or sdist): unpatched, batches over 10 pair loss masks with other samples' files; patched,
  every file, loss mask and ``sample_lengths.json`` entry is its sample's, also after a resume.
* the trainers' data paths (tests/clients/train_steps.py): 0.3.0's and 0.4.0's
  ``Eagle3SampleFileDataset`` + batch sampler + collate + optimizer steps of their Eagle3 draft
  over our ``extract`` output, and 0.9.0's ``ArrowDataset`` + ``CollateFn`` + draft over
  ``extract --format speculators-hs``.

Releases other than 0.3.0 live in <env>/speculators-releases/<version> (scripts/engine_env.py) and
are put first on PYTHONPATH of a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from speculators_compat import versions  # noqa: F401  (the skipif conditions)
from speculators_compat.testing import models

REPO = Path(__file__).resolve().parents[2]
CLIENTS = REPO / "tests" / "clients"
RELEASES = Path(sys.prefix) / "speculators-releases"
LAYERS = [1, 2, 3, 5]  # (4 distinct: the trainers' standardize step takes 3 + the last)


def release(v: str) -> Path:
    p = RELEASES / v
    if not (p / "speculators").is_dir():
        pytest.fail(f"speculators {v} is not installed at {p}: build this env with scripts/engine_env.py")
    return p


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def run_py(script: Path, args: list[str], mark: str, rel: Path | None = None, env: dict | None = None):
    """Run ``script`` in a fresh interpreter (a release first on PYTHONPATH); returns (json, log)."""
    full = dict(os.environ, **(env or {}))
    if rel is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(rel), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=full, timeout=900, cwd=REPO
    )
    log = (p.stdout + "\n" + p.stderr)[-6000:]
    for line in p.stdout.splitlines():
        if line.startswith(mark + " "):
            return json.loads(line[len(mark) + 1 :]), log
    return None, log


# -- 0.4.x's generator ---------------------------------------------------------------------------------

STRING_ORDER = sorted(range(14), key=lambda i: f"req_0_{i}")  # [0, 1, 10, 11, 12, 13, 2, ...]

# What unmodified speculators 0.4.0 does (its one CUDA call answered), per vLLM range: measured.
EXPECTED_04 = [
    (">=0.11,<0.12", "error", "No module named 'vllm.utils.hashing'"),  # at import
    (">=0.12,<0.17", "out_of_order", None),  # its own range: states right, rows string-sorted
    (">=0.17,<0.21", "error", "unexpected keyword argument 'eos_token_id'"),  # Request() at generate
]


def expectation_04(version):
    if transformers_major() >= 5:  # (its pydantic models cannot be built under transformers 5)
        return "error", "name 'torch' is not defined"
    for spec, kind, text in EXPECTED_04:
        if SpecifierSet(spec).contains(version, prereleases=True):
            return kind, text
    return None, None


def probe_04(env: dict):
    return run_py(REPO / "scripts" / "probes" / "probe_speculators04.py", [], "PROBE", release("0.4.0"), env)


def test_04_unpatched_as_measured(vllm_version):
    result, log = probe_04({"SPECULATORS_COMPAT_DISABLE": "1", "PROBE_STUB_CUDA_MEMORY": "1"})
    assert result is not None, f"probe crashed:\n{log}"
    print(f"vLLM {vllm_version}: speculators 0.4.0 unpatched -> {result}")
    if os.environ.get("SPECULATORS_COMPAT_RESULTS"):  # (CI keeps what upstream did, per version)
        with open(os.path.join(os.environ["SPECULATORS_COMPAT_RESULTS"], f"baseline04-{vllm_version}.json"), "w") as f:
            json.dump(result, f)
    assert result["speculators"] == "0.4.0" and result["patched"] is False
    kind, text = expectation_04(vllm_version)
    if kind is None:
        pytest.fail(f"no recorded expectation for vLLM {vllm_version}; speculators 0.4.0 did: {result}")
    if kind == "error":
        assert text in result.get("error", ""), result
    else:
        assert result["order"] == STRING_ORDER, result
        assert result["rows_matching_hf"] == 14, result  # each row's states are its own input's


def test_04_patched_contract(vllm_version):
    """Input order, HF-exact states (14 prompts over several chunked steps), repeated calls."""
    result, log = probe_04({})
    assert result is not None, f"probe crashed:\n{log}"
    print(f"vLLM {vllm_version}: speculators 0.4.0 patched -> {result}")
    assert result["speculators"] == "0.4.0" and result["patched"] is True
    if str(vllm_version).startswith("0.11."):  # its module imports vllm.utils.hashing (from 0.12)
        assert "vllm.utils.hashing" in result.get("error", ""), result
        return
    assert "error" not in result, log
    assert result["rows"] == 14 and result["in_input_order"], result
    assert result["rows_matching_hf"] == 14, result
    assert result["loss_mask"] == "None", result
    assert result["second_call"] == {"in_input_order": True, "rows_matching_hf": 14}, result


# -- the offline script and the trainers -----------------------------------------------------------------

N_SAMPLES = 24


@pytest.fixture(scope="module")
def script_dataset(tmp_path_factory):
    """24 tokenized rows (lengths 5..300) with distinct loss masks, as the script's dataset."""
    import datasets

    prompts = models.random_prompts([5 + (37 * i) % 296 for i in range(N_SAMPLES)], seed=11)
    masks = [[0] * (1 + i % (len(p) - 1)) + [1] * (len(p) - 1 - i % (len(p) - 1)) for i, p in enumerate(prompts)]
    d = tmp_path_factory.mktemp("script-dataset")
    datasets.Dataset.from_dict({"input_ids": prompts, "loss_mask": masks}).save_to_disk(str(d))
    return d, prompts, masks


def check_script_output(out: Path, prompts, masks, keeps_lengths: bool):
    """Per file: its sample's input_ids and loss mask; the lengths file names every file."""
    import torch

    wrong = []
    for i, (ids, mask) in enumerate(zip(prompts, masks)):
        d = torch.load(out / f"data_{i}.pt", weights_only=True)
        if d["input_ids"].tolist() != ids or d["loss_mask"].tolist() != mask:
            wrong.append(i)
    lengths = json.loads((out / "sample_lengths.json").read_text()) if keeps_lengths else None
    return wrong, lengths


def hf_check(out: Path, prompts, hf_ref, path):
    import torch

    from speculators_compat.testing import reference

    ref = hf_ref(path, LAYERS)
    states = [torch.load(out / f"data_{i}.pt", weights_only=True)["hidden_states"] for i in range(len(prompts))]
    dtype = str(states[0][0].dtype).replace("torch.", "")
    return reference.compare(states, prompts, ref, reference.TOLERANCE[dtype])


#: the trainers' forward uncompiled, as 0.4.0 itself runs it without CUDA (tests/clients/train_steps.py)
TRAIN_ENV = {"TORCHDYNAMO_DISABLE": "1"}


def offline_args(model, dataset, out, batch_size=14):
    return [
        "--model", model, "--dataset", str(dataset), "--output-dir", str(out),
        "--batch-size", str(batch_size), "--layer-ids", *map(str, LAYERS),
    ]  # fmt: skip


tf4_only = pytest.mark.skipif(
    "transformers_major() >= 5",
    reason="speculators 0.3.0/0.4.0's trainer config (pydantic over PretrainedConfig) cannot be built "
    "under transformers 5 (AttributeError __pydantic_fields_set__), and 0.4.0 requires transformers<=4.57.6: "
    "these run in the vLLM 0.16 cell",
)
one_cell_04 = pytest.mark.skipif(
    "not str(versions.installed_base('vllm')).startswith('0.16.')",
    reason="one cell: vLLM 0.16, the newest of speculators 0.4.x's own range (0.12-0.16)",
)


@tf4_only
@one_cell_04
def test_04_offline_script_unpatched_mispairs_loss_masks(script_dataset, llama_path, tmp_path):
    """Without us, its string-sorted batch makes its own script write other samples' loss masks."""
    d, prompts, masks = script_dataset
    res, log = run_py(
        CLIENTS / "offline_script.py",
        offline_args(llama_path, d, tmp_path),
        "DRIVER",
        release("0.4.0"),
        {"SPECULATORS_COMPAT_DISABLE": "1", "COMPAT_TEST_STUB_CUDA_MEMORY": "1"},
    )
    assert res is not None and res["saved"] == N_SAMPLES, log
    wrong, _ = check_script_output(tmp_path, prompts, masks, keeps_lengths=True)
    print(f"speculators 0.4.0 offline script unpatched: files with another sample's ids/mask: {wrong}")
    # batch 0 is inputs 0-13: files 2..13 hold inputs 10, 11, 12, 13, 2, ... with masks of 2..13
    assert len(wrong) >= 10, wrong


@tf4_only
@one_cell_04
@pytest.mark.parametrize("rel", ["0.3.0", "0.4.0"])
def test_offline_script_patched_then_trainer(rel, script_dataset, llama_path, hf_ref, tmp_path):
    """The script with ``import speculators_compat``: right files and lengths, a resume keeps them
    right, and the release's own trainer data path takes optimizer steps over them."""
    d, prompts, masks = script_dataset
    r = None if rel == "0.3.0" else release(rel)
    res, log = run_py(CLIENTS / "offline_script.py", offline_args(llama_path, d, tmp_path), "DRIVER", r)
    assert res is not None and res["speculators"] == rel and res["saved"] == N_SAMPLES, log
    keeps = rel != "0.3.0"
    wrong, lengths = check_script_output(tmp_path, prompts, masks, keeps)
    assert wrong == [], wrong
    if keeps:
        assert lengths == {str(i): len(p) for i, p in enumerate(prompts)}
    worst, bad = hf_check(tmp_path, prompts, hf_ref, llama_path)
    assert not bad, (worst, bad[:3])
    assert json.loads((tmp_path / "data_config.json").read_text())["hidden_states"]["layer_ids"] == LAYERS

    # a crash after file 15: the files from 16 on are gone; a rerun resumes at 16
    for i in range(16, N_SAMPLES):
        (tmp_path / f"data_{i}.pt").unlink()
    res, log = run_py(CLIENTS / "offline_script.py", offline_args(llama_path, d, tmp_path, 4), "DRIVER", r)
    assert res is not None and res["resumed_at"] == 16 and res["saved"] == N_SAMPLES - 16, log
    wrong, lengths2 = check_script_output(tmp_path, prompts, masks, keeps)
    assert wrong == [] and lengths2 == lengths

    train, log = run_py(
        CLIENTS / "train_steps.py", ["--data", str(tmp_path), "--verifier", llama_path], "TRAIN", r, TRAIN_ENV
    )
    assert train is not None, log
    print(f"speculators {rel} trainer over its offline script's files: {train}")
    assert train["speculators"] == rel and train["samples"] == N_SAMPLES and train["unavailable"] == 0, train
    assert train["finite"] and train["losses"][-1] < train["losses"][0], train  # the same batch: loss falls
    if keeps:  # 0.4.x batches by the exact lengths from sample_lengths.json
        assert train["approx_lengths"] == [len(prompts[int(p.stem[5:])]) for p in sorted(tmp_path.glob("data_*.pt"))]


@pytest.fixture(scope="module")
def extract_output(tmp_path_factory, llama_path):
    """``extract`` (default ``--format pt``) over 6 samples with partial loss masks."""
    from speculators_compat.pipeline.extract import run_extract

    d = tmp_path_factory.mktemp("extract-pt")
    prompts = models.random_prompts([7, 90, 33, 250, 12, 64], seed=5)
    masks = [[0] * (len(p) // 2) + [1] * (len(p) - len(p) // 2) for p in prompts]
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": p, "loss_mask": m}) + "\n" for p, m in zip(prompts, masks)))
    run_extract(llama_path, str(src), str(d / "out"), layer_ids=LAYERS, progress=False, max_model_len=512)
    return d / "out", prompts, masks


@tf4_only
@one_cell_04
@pytest.mark.parametrize("rel", ["0.3.0", "0.4.0"])
def test_trainer_on_extract_output(rel, extract_output, llama_path):
    """The release's trainer data path and training step over ``extract`` output; 0.4.0 batches by
    the exact lengths our sample_lengths.json gives it."""
    out, prompts, masks = extract_output
    assert json.loads((out / "sample_lengths.json").read_text()) == {str(i): len(p) for i, p in enumerate(prompts)}
    r = None if rel == "0.3.0" else release(rel)
    train, log = run_py(
        CLIENTS / "train_steps.py", ["--data", str(out), "--verifier", llama_path], "TRAIN", r, TRAIN_ENV
    )
    assert train is not None, log
    print(f"speculators {rel} trainer over extract output: {train}")
    assert train["speculators"] == rel and train["samples"] == len(prompts) and train["unavailable"] == 0, train
    assert train["finite"] and train["losses"][-1] < train["losses"][0], train
    order = [int(p.stem[5:]) for p in sorted(out.glob("data_*.pt"))]  # (its file list, string-sorted)
    assert train["loss_mask_sums"] == [sum(masks[i]) for i in order], train
    if rel != "0.3.0":
        assert train["approx_lengths"] == [len(prompts[i]) for i in order], train


@pytest.fixture(scope="module")
def fp8_extract_output(extract_output, llama_path):
    """The same samples extracted with ``--states-dtype fp8``."""
    from speculators_compat.pipeline.extract import run_extract

    out, _, _ = extract_output
    out8 = out.parent / "out-fp8"
    src = out.parent / "in.jsonl"
    run_extract(
        llama_path, str(src), str(out8), layer_ids=LAYERS, progress=False, max_model_len=512, states_dtype="fp8"
    )
    return out8


@tf4_only
@one_cell_04
@pytest.mark.parametrize("rel", ["0.3.0", "0.4.0"])
def test_trainer_on_fp8_extract_output(rel, extract_output, fp8_extract_output, llama_path):
    """``--states-dtype fp8`` data_{i}.pt files: with ``import speculators_compat`` (train_steps.py
    has it) the release's own dataset reads dequantized layers, within fp8's rounding (2^-4
    relative) of the same samples' unquantized files, and its draft trains on them; a reader
    without it fails on the first file, naming our loader, instead of reading e4m3 values as states."""
    out, prompts, masks = extract_output
    r = None if rel == "0.3.0" else release(rel)
    args = ["--data", str(fp8_extract_output), "--verifier", llama_path, "--compare", str(out)]
    train, log = run_py(CLIENTS / "train_steps.py", args, "TRAIN", r, TRAIN_ENV)
    assert train is not None, log
    print(f"speculators {rel} trainer over extract --states-dtype fp8: {train}")
    assert train["speculators"] == rel and train["samples"] == len(prompts) and train["unavailable"] == 0, train
    assert train["finite"] and train["losses"][-1] < train["losses"][0], train
    assert 0 < train["max_relative_error_vs_compare"] <= 2**-4, train
    order = [int(p.stem[5:]) for p in sorted(fp8_extract_output.glob("data_*.pt"))]
    assert train["loss_mask_sums"] == [sum(masks[i]) for i in order], train

    read, log = run_py(CLIENTS / "read_pt.py", ["--data", str(fp8_extract_output)], "READ", r, TRAIN_ENV)
    assert read is not None, log
    assert not read["compat_imported"] and "read" not in read, read
    assert "speculators_compat.engine.fp8.load_fp8_hidden_states" in read["error"], read
    read, log = run_py(CLIENTS / "read_pt.py", ["--data", str(out)], "READ", r, TRAIN_ENV)  # (unquantized: fine)
    assert read is not None and len(read["read"]) == len(prompts), log


# -- speculators >= 0.5: extract --format speculators-hs, read by 0.9.0's own loader and trainer ---------

one_cell_09 = pytest.mark.skipif(
    "not str(versions.installed_base('vllm')).startswith('0.32.')",
    reason="one cell: speculators 0.9.0 requires transformers >=5.0,<=5.19, i.e. vLLM 0.32's env (5.19)",
)
HS_LAYERS = [2, 3, 4, 6]  # vLLM's convention (id k: the output of k layers); 6, the last layer, included
HS_LENGTHS = [5, 40, 300, 17, 600, 90, 128, 3, 250, 61, 33, 200]  # 600: over max_model_len - 1 = 511


@pytest.fixture
def prepared_dataset(tmp_path):
    """What speculators >= 0.5's prepare_data.py saves: input_ids, loss_mask, seq_len, torch format."""
    import datasets

    prompts = models.random_prompts(HS_LENGTHS, seed=21)
    masks = [[0] * (len(p) // 3) + [1] * (len(p) - len(p) // 3) for p in prompts]
    d = tmp_path / "prepared"
    rows = {"input_ids": prompts, "loss_mask": masks, "seq_len": HS_LENGTHS}
    datasets.Dataset.from_dict(rows).with_format("torch").save_to_disk(str(d))
    return d, prompts, masks


@one_cell_09
def test_speculators_hs_output_read_by_newest_trainer(prepared_dataset, llama_path, hf_ref, tmp_path):
    """Its layout (hs_{i}.safetensors [T, L, H] + token_ids, the dataset beside), HF-exact per
    sequence and layer in vLLM's layer ids, checksummed and resumable; then 0.9.0's ArrowDataset
    reads every row (none unavailable) and its draft trains on them."""
    import datasets
    from safetensors.torch import load_file

    from speculators_compat.pipeline.extract import run_extract
    from speculators_compat.pipeline.output.verify import verify_output
    from speculators_compat.testing import reference

    d, prompts, masks = prepared_dataset
    out = tmp_path / "out"
    kw = dict(fmt="speculators-hs", progress=False, max_model_len=512)
    with pytest.raises(ValueError, match="on-overlength skip"):
        run_extract(llama_path, str(d), str(out), on_overlength="skip", **kw)
    with pytest.raises(ValueError, match="is the input dataset"):
        run_extract(llama_path, str(d), str(d), **kw)
    run_extract(llama_path, str(d), str(out), layer_ids=HS_LAYERS, batch_size=5, **kw)

    cut = [p[:511] for p in prompts]
    files = [load_file(out / "hidden_states" / f"hs_{i}.safetensors") for i in range(len(prompts))]
    assert [f["token_ids"].tolist() for f in files] == cut
    assert [tuple(f["hidden_states"].shape) for f in files] == [(len(c), 4, 128) for c in cut]
    dtype = str(files[0]["hidden_states"].dtype).replace("torch.", "")
    states = [[f["hidden_states"][:, j] for j in range(len(HS_LAYERS))] for f in files]
    worst, bad = reference.compare(
        states, cut, hf_ref(llama_path, [k - 1 for k in HS_LAYERS]), reference.TOLERANCE[dtype]
    )
    assert not bad, (worst, bad[:3])
    manifest = json.loads((out / "hidden_states" / "manifest.json").read_text())
    assert manifest["layer_ids_vllm"] == HS_LAYERS and manifest["dataset"]["rows"] == len(prompts)
    assert verify_output(out)["ok"]
    ds = datasets.load_from_disk(str(out)).with_format(None)
    assert ds["input_ids"] == cut and ds["loss_mask"] == [m[:511] for m in masks]
    assert ds["seq_len"] == [len(c) for c in cut]

    # a lost file: verify names it; a rerun recomputes its batch and writes it again, byte for byte
    victim = out / "hidden_states" / "hs_7.safetensors"
    before = victim.read_bytes()
    victim.unlink()
    res = verify_output(out)
    assert not res["ok"] and any("hs_7.safetensors" in p for p in res["problems"]), res
    run_extract(llama_path, str(d), str(out), layer_ids=HS_LAYERS, batch_size=5, **kw)
    assert victim.read_bytes() == before and verify_output(out)["ok"]

    train, log = run_py(
        CLIENTS / "train_steps.py",
        ["--data", str(out), "--verifier", llama_path, "--format", "hs", "--target-layer-ids", "2,3,4"],
        "TRAIN",
        release("0.9.0"),
        TRAIN_ENV,
    )
    assert train is not None, log
    print(f"speculators 0.9.0 trainer over extract --format speculators-hs: {train}")
    assert train["speculators"] == "0.9.0" and train["samples"] == len(prompts) and train["unavailable"] == 0, train
    assert train["loss_mask_sums"] == [sum(m[:511]) for m in masks], train
    assert train["approx_lengths"] == [len(c) for c in cut], train
    assert train["finite"] and train["losses"][-1] < train["losses"][0], train


@one_cell_09
def test_fp8_speculators_hs_read_by_newest_trainer(prepared_dataset, llama_path, tmp_path):
    """``--format speculators-hs --states-dtype fp8``: 0.9.0's ArrowDataset with its ``fp8``
    hidden-states backend (hs-connectors' FP8Transfer, as its trainer's ``--hidden-states-backend
    fp8`` builds it) reads every row within fp8's rounding of the unquantized run's, and its draft
    trains on them. (Bytes and arithmetic against hs-connectors: tests/engine/test_fp8_states.py.)"""
    from speculators_compat.pipeline.extract import run_extract
    from speculators_compat.pipeline.output.verify import verify_output

    d, prompts, masks = prepared_dataset
    kw = dict(fmt="speculators-hs", progress=False, max_model_len=512, layer_ids=HS_LAYERS, batch_size=5)
    run_extract(llama_path, str(d), str(tmp_path / "bf16"), **kw)
    run_extract(llama_path, str(d), str(tmp_path / "fp8"), states_dtype="fp8", **kw)
    assert verify_output(tmp_path / "fp8")["ok"]
    args = ["--verifier", llama_path, "--format", "hs", "--target-layer-ids", "2,3,4"]
    train, log = run_py(
        CLIENTS / "train_steps.py",
        ["--data", str(tmp_path / "fp8"), "--backend", "fp8", "--compare", str(tmp_path / "bf16"), *args],
        "TRAIN",
        release("0.9.0"),
        TRAIN_ENV,
    )
    assert train is not None, log
    print(f"speculators 0.9.0 trainer over extract --format speculators-hs --states-dtype fp8: {train}")
    assert train["samples"] == len(prompts) and train["unavailable"] == 0, train
    assert train["loss_mask_sums"] == [sum(m[:511]) for m in masks], train
    assert 0 < train["max_relative_error_vs_compare"] <= 2**-4, train
    assert train["finite"] and train["losses"][-1] < train["losses"][0], train

"""A format added in one module (toy_format.py, registered by importing it) is handled by every
command: extract writes its files with the states HF computes, verify checks them and finds a
damaged one, a resume computes only the sample whose file is missing, plan sizes it. Each command
runs in a process of its own that imports the module first, as a user's plugin would."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from speculators_compat.testing import reference
from tests.helpers import make_jsonl

pytestmark = pytest.mark.ends  # (the library's own formats over a real engine: the newest cell)

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [1, 3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys, tests.engine.toy_format\nfrom speculators_compat.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


def _extract(model: str, inp: Path, out: Path) -> subprocess.CompletedProcess:
    ids = ",".join(map(str, LAYERS))
    return _cli(
        "extract", "--model", model, "--input", str(inp), "--output", str(out), "--format", "toy-npz",
        "--layer-ids", ids, "--dtype", "float32", "--batch-size", "3", "--max-model-len", "512", "--no-progress",
    )  # fmt: skip


def test_a_format_in_one_module_is_extracted_verified_resumed_and_planned(llama_path, hf_ref, tmp_path):
    from tests.engine import toy_format

    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = make_jsonl(inp, lengths=[17, 40, 9, 63, 25, 31, 12])
    r = _extract(llama_path, inp, out)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(p.name for p in out.glob("toy_*.npz"))
    assert files == [f"toy_{i}.npz" for i in range(len(rows))]
    ref, tol = hf_ref(llama_path, LAYERS), reference.TOLERANCE["float32"]
    got = [toy_format.read(out / f"toy_{i}.npz") for i in range(len(rows))]
    assert [g["input_ids"].tolist() for g in got] == [row["input_ids"] for row in rows]
    prompts = [row["input_ids"] for row in rows]  # float32 states against HF's, per sample and layer
    worst, bad = reference.compare([g["hidden_states"] for g in got], prompts, ref, tol)
    assert not bad, (worst, bad[:3])

    r = _cli("verify", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    kept = (out / "toy_3.npz").read_bytes()
    (out / "toy_3.npz").write_bytes(kept[:-9] + bytes(9))
    r = _cli("verify", str(out))
    assert r.returncode != 0 and "toy_3.npz" in r.stdout + r.stderr

    (out / "toy_3.npz").unlink()  # resume: only the missing sample's batch is computed again
    r = _extract(llama_path, inp, out)
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads((out / "runs.jsonl").read_text().splitlines()[-1])
    assert last["new_files"] == 1 and last["computed"] <= 3, last  # (3: --batch-size)
    again = toy_format.read(out / "toy_3.npz")["hidden_states"]
    assert not reference.compare([again], [prompts[3]], ref, tol)[1]
    assert _cli("verify", str(out)).returncode == 0

    r = _cli("plan", "--model", llama_path, "--format", "toy-npz", "--layer-ids", "1,3", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["layer_ids"] == LAYERS

"""``speculators-compat run python SCRIPT``: an unchanged script that imports speculators' generator
at top level, without ``import speculators_compat``, extracts HF-exact states.

Without the launcher, importing speculators_compat before running the script (``python -c "import
speculators_compat, runpy; runpy.run_path(...)"``) patches the driver only: each spawned vLLM worker
re-imports the script as its ``__mp_main__`` and reaches ``import speculators`` before vLLM loads
our plugin, which under transformers 5 fails (``NameError: name 'torch' is not defined``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculators_compat.testing import models, reference

pytestmark = pytest.mark.ends  # (the launcher is no version-specific capture: the newest cell)

SCRIPT = """
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
import json
import sys

import torch


def main():
    model, prompts, out = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
    gen = VllmHiddenStatesGenerator(model, layer_ids=[1, 3, 5], max_model_len=2048)
    res = gen.generate(prompts)
    torch.save([[h.clone() for h in r["hidden_states"]] for r in res], out)
    print("done", len(res))


if __name__ == "__main__":
    main()
"""

ENV = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")


@pytest.fixture
def script(tmp_path):
    (tmp_path / "extract_script.py").write_text(SCRIPT)
    prompts = models.random_prompts([40, 300, 7, 120, 64, 900, 5, 33, 250, 17, 80, 12], seed=21)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    return tmp_path, prompts


def test_an_unchanged_script_through_the_launcher_matches_hf(script, llama_path, hf_ref):
    import torch

    d, prompts = script
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "speculators_compat.cli",
            "run",
            sys.executable,
            str(d / "extract_script.py"),
            llama_path,
            str(d / "prompts.json"),
            str(d / "states.pt"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=d,
        timeout=900,
    )
    assert r.returncode == 0 and "done 12" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    states = torch.load(d / "states.pt", weights_only=True)
    # dtype "auto": bf16 on CPU for these float32 checkpoints (upstream's setting)
    worst, bad = reference.compare(states, prompts, hf_ref(llama_path, [1, 3, 5]), reference.TOLERANCE["bfloat16"])
    assert not bad, (worst, bad[:5])


def test_without_the_launcher_the_workers_are_not_patched(script, llama_path):
    """The baseline the launcher exists for (transformers 5 only: under 4.x speculators imports)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__}: importing speculators needs no patch")
    d, _ = script
    code = f"import speculators_compat, runpy; runpy.run_path({str(d / 'extract_script.py')!r}, run_name='__main__')"
    r = subprocess.run(
        [sys.executable, "-c", code, llama_path, str(d / "prompts.json"), str(d / "states.pt")],
        capture_output=True,
        text=True,
        env=dict(ENV, PYTHONPATH=str(Path.cwd())),
        cwd=d,
        timeout=900,
    )
    assert r.returncode != 0 and "name 'torch' is not defined" in r.stdout + r.stderr, (
        r.stdout[-2000:] + r.stderr[-3000:]
    )

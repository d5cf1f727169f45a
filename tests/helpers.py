"""Test helpers shared by test modules (which never import each other): run a Python snippet in a
fresh interpreter (spawned vLLM workers need a real ``__main__`` file) and read back a JSON result;
the pipeline's input and output as tests make and read them; the drop-in generator checked
against HF."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

RESULT_MARK = "@@RESULT@@"
#: speculators releases other than the env's own, installed beside it by scripts/engine_env.py
RELEASES = Path(sys.prefix) / "speculators-releases"


def from_release(version: str, *modules: str) -> list:
    """``modules`` imported from speculators release ``version`` (installed beside this engine
    environment); FileNotFoundError when there is none. A module whose top package is already
    imported here from elsewhere (``speculators``: the env's own release) is loaded from its file
    alone, apart from that package: only for modules that import nothing of their own package
    (``speculators.data_generation.vllm_client``)."""
    import importlib
    import importlib.util

    root = RELEASES / version
    if not root.is_dir():
        raise FileNotFoundError(
            f"speculators {version} is not installed at {root} (scripts/engine_env.py puts it there)"
        )
    out = []
    for name in modules:
        top = sys.modules.get(name.split(".")[0])
        if top is not None and not str(getattr(top, "__file__", "")).startswith(str(root)):
            path = root / (name.replace(".", "/") + ".py")
            spec = importlib.util.spec_from_file_location(f"release_{version}_{name}".replace(".", "_"), path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            out.append(mod)
            continue
        sys.path.insert(0, str(root))
        try:
            out.append(importlib.import_module(name))
        finally:
            sys.path.remove(str(root))
    return out


PRELUDE = """
import json, os, sys, traceback
def emit(obj):
    print("@@RESULT@@" + json.dumps(obj), flush=True)
"""


def run_snippet(body: str, env: dict | None = None, timeout: int = 900) -> tuple[dict | None, str]:
    """Run ``body`` as the ``main()`` of a script; it calls ``emit(obj)`` to report. Returns (obj, log)."""
    code = (
        PRELUDE
        + "\ndef main():\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "\n\nif __name__ == '__main__':\n    main()\n"
    )
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "snippet.py"
        f.write_text(code)
        full_env = dict(os.environ)
        full_env.update(env or {})
        p = subprocess.run(
            [sys.executable, str(f)], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=d
        )
    log = p.stdout + "\n" + p.stderr
    result = None
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
    return result, log[-6000:]


# -- the pipeline's input and output ----------------------------------------------------------------
LENGTHS = [5, 300, 37, 120, 900, 17, 64, 8, 450, 50, 99, 10, 2100, 11]  # 2100 > max_model_len


def make_jsonl(path: Path, lengths=LENGTHS, seed=0) -> list[dict]:
    """A JSONL input of random prompts; every fourth has no loss_mask, the others a patterned one."""
    from speculators_compat.testing import models

    rows = []
    for i, ids in enumerate(models.random_prompts(lengths, seed=seed)):
        mask = [(j + i) % 3 != 0 for j in range(len(ids))]
        rows.append({"input_ids": ids, "loss_mask": [int(m) for m in mask]} if i % 4 else {"input_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def read_dir(d: Path) -> dict[str, bytes]:
    """An output's data files and manifest, by name (to compare two datasets byte for byte)."""
    return {
        p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.startswith("data_") or p.name == "manifest.json"
    }


# -- the generator against HF --------------------------------------------------------------------
def check_generate(gen, path, prompts, hf_ref, layers, tol):
    """``gen.generate(prompts)``, checked: input order, every layer within ``tol`` of HF."""
    from speculators_compat.testing import reference

    res = gen.generate(prompts)
    reference.check_results(res, prompts, hf_ref(path, layers), tol)
    return res

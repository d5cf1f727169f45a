"""``speculators-compat run``: the bootstrap reaches a plain interpreter without importing torch
or vLLM, keeps the environment's own sitecustomize, and names a missing command. The real-engine
case (spawned workers of an unchanged script) is tests/engine/test_launcher.py."""

import os
import subprocess
import sys

ENV = dict(os.environ)


def test_the_launcher_keeps_an_environments_own_sitecustomize(tmp_path):
    own = tmp_path / "site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "speculators_compat.cli",
            "run",
            sys.executable,
            "-c",
            "import os, sys; print(os.environ.get('OWN_SITECUSTOMIZE'), 'speculators_compat' in sys.modules,"
            " 'torch' in sys.modules, 'vllm' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        env=dict(ENV, PYTHONPATH=str(own)),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ran", "True", "False", "False"]


def test_the_launcher_names_a_missing_command():
    r = subprocess.run(
        [sys.executable, "-m", "speculators_compat.cli", "run", "no-such-command-here"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "command 'no-such-command-here' not found" in r.stderr

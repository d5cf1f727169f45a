"""Test helpers: run a Python snippet in a fresh interpreter (spawned vLLM workers need a real
``__main__`` file) and read back a JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

RESULT_MARK = "@@RESULT@@"

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

"""``speculators-compat run COMMAND [ARGS...]``: run an unchanged script with the patches in every
process it starts.

``import speculators_compat`` at the top of a script patches that process; vLLM's plugin entry
point patches its worker processes once vLLM loads its plugins. A spawned worker first re-imports
the user's script as its ``__mp_main__``, though, and a script that imports speculators at top level
reaches that import before any plugin is loaded (under transformers 5: ``NameError: name 'torch'
is not defined``). The launcher puts ``speculators_compat/bootstrap`` first on ``PYTHONPATH``, whose
``sitecustomize`` imports speculators_compat when each interpreter starts: the command's own, its
spawned and forked workers, and any Python it starts in turn. Then it replaces itself with the
command (``exec``: same pid, signals and exit status go straight to it).

Not reached: an interpreter started with ``-S`` (no site) or ``-I`` / ``-E`` (``PYTHONPATH`` ignored).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"


def launch_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with the bootstrap directory, and the directory that holds
    speculators_compat itself (so a source checkout works uninstalled), first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    first = [str(BOOTSTRAP), str(BOOTSTRAP.parents[1])]
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(first + rest)
    return env


def main_run(command: list[str]) -> int:
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("run needs a command, e.g. speculators-compat run python my_script.py --flag")
    exe = shutil.which(command[0])
    if exe is None:
        raise FileNotFoundError(f"run: command {command[0]!r} not found")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, command, launch_env())
    return 127  # (not reached: execve replaced this process)

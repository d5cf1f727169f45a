"""Imported by Python's ``site`` at the start of every interpreter whose ``PYTHONPATH`` holds this
directory (``speculators-compat run`` sets it): imports speculators_compat before anything else,
so the patches are registered before a script, or a spawned worker re-running that script as its
``__mp_main__``, imports speculators or vLLM. Then it runs the ``sitecustomize`` this one hides,
if there is one further down the path (an environment's own), so that keeps working."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import speculators_compat  # noqa: F401  (registers the patches; imports neither vLLM nor torch)
except Exception as e:  # the user's command still runs, and is told why it runs unpatched
    sys.stderr.write(
        f"speculators-compat run: importing speculators_compat failed ({type(e).__name__}: {e}); "
        "the command runs without its patches\n"
    )


def _run_the_hidden_one() -> None:
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or os.path.dirname(os.path.abspath(spec.origin or "")) == _HERE:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_run_the_hidden_one()

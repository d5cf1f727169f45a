"""vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``load_general_plugins()`` in every process it starts (engine core, each worker, under
fork and spawn) before work begins, so this is how worker-side patches reach workers without any
driver state. vLLM may call it several times per process: ``install()`` is idempotent.
"""

from __future__ import annotations


def register() -> None:
    from . import hooks

    hooks.install()

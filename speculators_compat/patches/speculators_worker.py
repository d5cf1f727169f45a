"""speculators 0.3.0 ``HiddenStatesWorkerExtension`` (runs inside vLLM worker processes).

Upstream's worker extension replaces the decoder stack's ``forward`` with a copy of the Llama
loop. From vLLM 0.12 that copy calls the removed ``get_input_embeddings`` (AttributeError at the
first forward), it rejects DeepSeek-V3/Kimi before 0.18 (``supports_eagle3``) and cannot find
Kimi-K2.5's decoder (``model.model``). This patch keeps the extension's RPC contract
(``_setup_hidden_states_capture(layer_ids)``, ``_reset_capture()``, ``_get_captured_states()`` ->
one tensor per captured layer, ascending, rows in execution order) but captures with forward hooks
on the real decoder layers, leaving vLLM's own forward untouched. Under Model Runner V2 (the only
runner from vLLM 0.34), which runs a step's requests sorted by token count, each step's rows are
put back in the scheduler's order: the order the V1 runner runs a fresh batch in, and the one a
caller slicing rows by its own request order relies on.

This is a worker-side fix: it must be applied in each worker process, which the vLLM plugin entry
point (``vllm.general_plugins``) does under both fork and spawn.
"""

from __future__ import annotations

from ..registry import Patch

_METHODS = ("_setup_hidden_states_capture", "_reset_capture", "_get_captured_states")


def _setup(self, layer_ids):
    from ..engine.capture import install_capture

    self._layer_ids = frozenset(layer_ids)
    self._captured_states = None
    install_capture(self, sorted(set(layer_ids)), record_all=True)


def _reset(self):
    if not hasattr(self, "_layer_ids"):
        raise RuntimeError("Must call _setup_hidden_states_capture before capturing states")
    st = getattr(self, "_compat_capture", None)
    if st is not None:
        st.all_rows = []


def _get(self):
    from ..engine.capture import take_all_rows

    return take_all_rows(self)


_REPLACEMENTS = {"_setup_hidden_states_capture": _setup, "_reset_capture": _reset, "_get_captured_states": _get}


class SpeculatorsWorkerPatch(Patch):
    name = "speculators_worker_extension"
    module = "speculators.data_generation.custom_worker"
    targets = tuple(f"speculators.data_generation.custom_worker:HiddenStatesWorkerExtension.{m}" for m in _METHODS)
    package = "speculators"
    versions = "==0.3.0"
    process = "worker"
    risk = "low: speculators pinned; capture reaches vLLM only via model_runner.model/input_batch"
    description = (
        "upstream's replacement decoder forward calls get_input_embeddings (gone in 0.12) "
        "and cannot find DeepSeek/Kimi-K2.5 decoders: capture with hooks instead"
    )
    test = "tests/engine/test_patches_engine.py::test_upstream_worker_extension_patch"

    def needed(self, module):
        return "upstream's patched decoder forward breaks on vLLM >= 0.12 and on DeepSeek/Kimi"

    def _apply(self, module):
        self.replace_methods(module.HiddenStatesWorkerExtension, _REPLACEMENTS)

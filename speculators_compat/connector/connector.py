"""``CaptureConnector``: vLLM's KV-connector interface over our capture, so vLLM's own server
(``vllm serve``) and ``LLM(...)`` write speculators' hidden-states files, with no speculative config.

    vllm serve MODEL --enforce-eager --no-enable-prefix-caching --kv-transfer-config '{
        "kv_connector": "CaptureConnector",
        "kv_connector_module_path": "speculators_compat.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/shared/hs", "layer_ids": [2, 14, 26, 32]}}'

One class, two roles, as vLLM's connectors are built: vLLM makes one instance in its scheduler
(scheduler.py: which requests, which files, the step record) and one in every worker (worker.py:
the capture, the checks, the writes). It refuses, when vLLM builds it (after the weights are loaded:
``speculators-compat serve`` sets the flags itself), what it cannot capture right: a cached prefix is never computed (prefix caching must be off), a compiled or CUDA-graph
forward never runs the capture hooks (eager only), and pipeline stages write one file from
several processes (one stage only).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from ..layers import resolve
from .records import CaptureStep, ConnectorSettings
from .scheduler import SchedulerSide
from .worker import WorkerSide, find_runner

logger = logging.getLogger("speculators_compat.connector")


def check_config(vllm_config) -> None:
    """What the capture cannot do, each named with the flag that avoids it."""
    problems = []
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        problems.append(
            "prefix caching is on: a cached prefix is never computed, so its states would be missing "
            "(--no-enable-prefix-caching)"
        )
    if not getattr(vllm_config.model_config, "enforce_eager", False):
        problems.append(
            "the model is compiled (CUDA graphs / torch.compile): the capture hooks run only in an eager "
            "forward (--enforce-eager)"
        )
    if int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)) > 1:
        problems.append(
            "pipeline parallelism: each stage holds some layers of a file this connector writes from one "
            "process (use tensor parallelism, or `speculators-compat extract` for pipeline stages)"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("a speculative config is set: this connector captures the layers itself (drop it)")
    if problems:
        raise ValueError("speculators_compat CaptureConnector cannot run here: " + "; ".join(problems))


def layer_ids_for(vllm_config, settings: ConnectorSettings) -> list[int]:
    """The captured layers in upstream's convention, from the settings' ids in vLLM's (default:
    speculators >= 0.5's ``[2, n//2, n-3, n]``): one rule, layers.resolve."""
    hf = vllm_config.model_config.hf_text_config
    n = int(hf.num_hidden_layers)
    ids = list(settings.layer_ids) if settings.layer_ids is not None else None
    return resolve(ids, n, "eagle3", "speculators-hs")


class CaptureConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra(extra)
        check_config(vllm_config)
        self.layer_ids = layer_ids_for(vllm_config, self.settings)
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.sched = SchedulerSide(self.settings, int(vllm_config.model_config.max_model_len))
        else:
            self.worker = WorkerSide(self.settings, self.layer_ids)

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self.worker.register(find_runner())

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None  # nothing is loaded: the connector only saves

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # (the capture hooks took the layers' outputs in the forward)

    def wait_for_save(self):
        return None  # (the step's record is handled in get_finished: see there)

    def get_finished(self, finished_req_ids):
        # Every step ends here, a step with no tokens too; wait_for_save is skipped in those on some
        # versions (vLLM 0.20's kv_connector_no_forward), and the record that finishes the last
        # requests of a burst comes in exactly such a step.
        if self.has_connector_metadata():
            self.worker.end_step(self._get_connector_metadata())
        return self.worker.finished_sending(finished_req_ids), None

    def get_finished_count(self) -> int | None:
        return 1  # one worker writes each file (the first tensor-parallel rank)

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output) -> CaptureStep:
        return self.sched.build(scheduler_output)

    def request_finished(self, request, block_ids):
        return self.sched.finished(request)

"""The connector's scheduler side (vLLM's engine-core process): which requests are captured, where
each one's file goes, and the step record (records.CaptureStep) that tells the workers.

Which requests: a request is captured when its ``kv_transfer_params`` ask for it
(``include_output_tokens``, or ``capture_hidden_states: true``), or when it generates one token
(``max_tokens=1``: speculators' states call, ``generate-offline-data`` and online training);
``capture_hidden_states: false`` turns capture off for a request. Anything else (chat answers of
``regenerate-responses``, ``render``) is served as vLLM serves it, with no file.

The file: ``<shared_storage_path>/<request id>.safetensors``. A path a client sends is ignored: no
request chooses where the server writes.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from .records import CaptureStep, ConnectorSettings, FinishedCapture, NewCapture

logger = logging.getLogger("speculators_compat.connector")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def wants_capture(sampling_params: Any) -> tuple[bool, bool]:
    """(capture this request?, with its output tokens?) from its sampling parameters."""
    if sampling_params is None:  # a pooling request: nothing is sampled
        return False, False
    extra = getattr(sampling_params, "extra_args", None) or {}
    kv = extra.get("kv_transfer_params") or {}
    if not isinstance(kv, dict):
        return False, False
    outputs = bool(kv.get("include_output_tokens", False))
    asked = kv.get("capture_hidden_states")
    if asked is False:
        return False, False
    if asked or outputs:
        return True, outputs
    return getattr(sampling_params, "max_tokens", None) == 1, False


def file_for(folder: str, req_id: str) -> str:
    name = _UNSAFE.sub("_", req_id)[:200] or "request"
    return os.path.join(folder, f"{name}.safetensors")


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, max_model_len: int):
        self.settings = settings
        self.max_model_len = max_model_len
        self.captured: dict[str, NewCapture] = {}  # in flight
        self.outputs: set[str] = set()  # of those, the ones that keep their output tokens too
        self.step = CaptureStep()  # what the next step tells the workers

    def build(self, scheduler_output) -> CaptureStep:
        step, self.step = self.step, CaptureStep()
        for new in scheduler_output.scheduled_new_reqs:
            cap = self._new(new)
            if cap is not None:
                step.new.append(cap)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for rid in getattr(cached, "resumed_req_ids", None) or ():
            if rid in self.captured:
                step.restarted.append(rid)
        return step

    def _new(self, new) -> NewCapture | None:
        want, outputs = wants_capture(new.sampling_params)
        ids = new.prompt_token_ids
        if not want:
            return None
        if ids is None:  # (prompt embeddings: no token ids to write beside the states)
            logger.warning("speculators_compat: request %s has no prompt token ids: not captured", new.req_id)
            return None
        if new.num_computed_tokens:  # (refused at start: prefix caching is off; a KV load would do it)
            logger.error(
                "speculators_compat: request %s starts at position %d (its prefix was not computed): not captured",
                new.req_id,
                new.num_computed_tokens,
            )
            return None
        plen = len(ids)
        length = plen
        if outputs:
            max_tokens = getattr(new.sampling_params, "max_tokens", None) or self.max_model_len
            length = min(plen + max_tokens - 1, self.max_model_len - 1)
            self.outputs.add(new.req_id)
        cap = NewCapture(new.req_id, file_for(self.settings.path, new.req_id), plen, max(length, plen))
        self.captured[new.req_id] = cap
        return cap

    def finished(self, request) -> tuple[bool, dict | None]:
        """vLLM's ``request_finished``: the file's path for the response (the workers write it
        next step, under the lock they took when the request arrived), or nothing."""
        rid = request.request_id
        cap = self.captured.pop(rid, None)
        outputs = rid in self.outputs
        self.outputs.discard(rid)
        if cap is None:
            return False, None
        if _aborted(request):
            self.step.dropped.append(FinishedCapture(rid, cap.path, []))
            return False, None
        if outputs:  # the last token was sampled, never an input: it has no state
            ids = list(request.all_token_ids)[:-1]
        else:
            ids = list(request.prompt_token_ids)
        self.step.finished.append(FinishedCapture(rid, cap.path, [int(t) for t in ids]))
        return True, {"hidden_states_path": cap.path}


def _aborted(request) -> bool:
    status = getattr(request, "status", None)
    return getattr(status, "name", "") in ("FINISHED_ABORTED", "FINISHED_ERROR")

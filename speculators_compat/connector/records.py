"""What crosses from the connector's scheduler side to its worker side, once a step (vLLM pickles
the step's metadata to every worker with the ``SchedulerOutput``), and the connector's settings.

``CaptureStep``: the requests that start being captured this step (where their file goes, how many
positions to keep), those whose capture restarts (resumed after a preemption: their positions are
computed again from 0), those finished (write their file) and those dropped (aborted: write nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.config import check_states_dtype

try:  # the base class vLLM's scheduler hands to its workers (absent only outside vLLM: unit tests)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as _Meta
except ImportError:  # pragma: no cover

    class _Meta:  # type: ignore[no-redef]
        pass


@dataclass
class NewCapture:
    req_id: str
    path: str  # the hs file this request's states go to
    prompt_len: int  # the self-check's position: the last prompt token (its sampled token)
    capture_len: int  # positions kept at most: the prompt, or prompt + max_tokens - 1 with output tokens


@dataclass
class FinishedCapture:
    req_id: str
    path: str
    token_ids: list[int]  # the file's token_ids: the positions captured, one id each


@dataclass
class CaptureStep(_Meta):
    new: list[NewCapture] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    finished: list[FinishedCapture] = field(default_factory=list)
    dropped: list[FinishedCapture] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.new or self.restarted or self.finished or self.dropped)


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, checked. ``layer_ids`` in vLLM's convention (id k: the output
    of k decoder layers; speculators >= 0.5's and vLLM's ``eagle_aux_hidden_state_layer_ids``)."""

    path: str
    layer_ids: tuple[int, ...] | None = None
    states_dtype: str = "auto"
    self_check: bool = True

    @classmethod
    def from_extra(cls, extra: dict | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {"shared_storage_path", "layer_ids", "states_dtype", "self_check"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"speculators_compat connector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"it takes {sorted(known)}"
            )
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError(
                "speculators_compat connector: kv_connector_extra_config needs shared_storage_path, the "
                "folder each request's hidden-states file is written to"
            )
        ids = extra.get("layer_ids")
        if ids is not None:
            if isinstance(ids, str):
                ids = [int(x) for x in ids.split(",") if x.strip()]
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise ValueError(f"speculators_compat connector: layer_ids must be a list of integers, not {ids!r}")
            ids = tuple(ids)
        dtype = extra.get("states_dtype", "auto")
        try:
            check_states_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"speculators_compat connector: {e}") from None
        check = extra.get("self_check", True)
        if not isinstance(check, bool):
            raise ValueError(f"speculators_compat connector: self_check must be true or false, not {check!r}")
        return cls(path, ids, dtype, check)

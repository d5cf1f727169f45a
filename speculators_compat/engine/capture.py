"""The capture itself, inside each vLLM worker: forward hooks on the decoder layers that write each
step's kept rows (``hidden_states + residual``) into the arena, and ``take``, which hands a
batch's rows back per request. Which rows are kept, for whom, is attribution.py's.

FP8 states (``fp8``): a token's scale spans every captured layer, so each layer's kept rows of a
step stay on the device, unquantized, until the last captured layer ran; then the step is
quantized there (fp8.py's arithmetic) and only e4m3 rows and one float32 scale per token cross
to the host. Device memory held for it is one step's kept rows (bounded by the step's token
budget, not by prompt length). The NaN/Inf flags and the self-check use the unquantized rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import fp8 as fp8_mod
from . import witness
from .arena import Arena
from .attribution import (
    coverage_problem,
    merge_adjacent,
    plan_rows,
    runner_kind,
    scheduler_order,
    step_requests,
    step_starts,
)
from .rows import SCALES, _make_layer_hook
from .stage import _ensure_stage_buffer, pipeline_stage, shares_driver_shm

logger = logging.getLogger("speculators_compat.worker")


def find_base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (the module with ``.layers``) inside a vLLM model.

    Handles text models (``model.model``), multimodal wrappers that expose ``get_language_model()``
    (Kimi-K2.5 in vLLM 0.16+: ``language_model.model``; 0.15: ``language_model`` is the decoder
    itself) and a bare ``language_model`` attribute.
    """
    candidates = []
    lm = None
    if hasattr(model, "get_language_model"):
        try:
            lm = model.get_language_model()
        except (AttributeError, NotImplementedError) as e:  # some wrappers raise until configured
            logger.debug("get_language_model() failed on %s: %s", type(model).__name__, e)
    for root in (lm, getattr(model, "language_model", None), model):
        if root is None:
            continue
        candidates.append(getattr(root, "model", None))
        candidates.append(root)
    for c in candidates:
        if isinstance(c, torch.nn.Module) and isinstance(getattr(c, "layers", None), torch.nn.ModuleList):
            return c
    raise RuntimeError(
        f"speculators_compat: cannot find the decoder layers of {type(model).__name__}: none of "
        "model.model, model.get_language_model()(.model) or model.language_model(.model) has a "
        "`.layers` ModuleList. This architecture is not supported for hidden-state capture."
    )


@dataclass
class _Segment:
    start: int
    layers: list  # per captured layer (in layer_ids order): (buffer index, byte offset, rows)


@dataclass
class _CaptureState:
    layer_ids: list[int]
    handles: list = field(default_factory=list)
    expected: dict = field(default_factory=dict)  # req_id -> positions to keep (the prompt length)
    check_at: dict = field(default_factory=dict)  # req_id -> the self-check's position + 1, where not expected's
    order: dict = field(default_factory=dict)  # req_id -> announcement serial (the arena's order)
    serial: int = 0
    segments: dict = field(default_factory=dict)  # req_id -> list[_Segment]
    scheduler_output: Any = None
    runner_kind: str = "v1"  # "v1": runner.input_batch; "v2": the step's batch from prepare_inputs
    step_batch: Any = None  # Model Runner V2: the InputBatch prepare_inputs built for this step
    layout: Any = None  # (req_ids, counts, starts) of the current forward (positions checked)
    plan: Any = None  # this forward's kept rows: (source rows: slice | index tensor, [(rid, start, n, row)])
    rows: dict = field(default_factory=dict)  # layer id -> (buffer, offset) or tensor (record_all)
    record_order: Any = None  # record_all under V2: step rows -> scheduler order (index), None: as run
    arena: Any = None
    hidden: int = 0
    dtype: Any = None
    pending_event: Any = None
    copy_stream: Any = None  # GPU: side stream for device->host copies into the pinned arena
    record_all: bool = False
    all_rows: list = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    t_hooks: float = 0.0  # seconds inside capture hooks (device->host copies issued/done)
    t_take: float = 0.0  # seconds assembling and handing off in take()
    t_expect: float = 0.0  # seconds in compat_capture_expect (readying the arena for a batch)
    nonfinite: list = field(default_factory=list)  # device flags: did a step's layer hold NaN/Inf?
    regions: dict = field(default_factory=dict)  # req_id -> {layer id: (buffer, byte offset)} of its prompt
    region_row_bytes: int = 0  # the row size those regions were sized with
    fault: Any = None  # a test's injected fault (faults.Fault), None in use
    fp8: bool = False  # store e4m3 rows and per-token float32 scales (module docstring)
    pending: dict = field(default_factory=dict)  # fp8: layer id -> this step's unquantized kept rows
    stage: int = 0  # this worker's pipeline stage
    final: int = -1  # the id of the final state after the norm (the decoder layer count; layers.py)

    @property
    def store_dtype(self):
        """The dtype of the rows in the arena: e4m3 for FP8 states, else the model's."""
        return fp8_mod.fp8_dtype() if self.fp8 else self.dtype

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.store_dtype.itemsize

    @property
    def entries(self) -> list:
        """What each request's rows are kept as, in order: the captured layers, then (FP8) the
        scales; the keys of its regions."""
        return [*self.layer_ids, SCALES] if self.fp8 else list(self.layer_ids)

    def entry_shape(self, key) -> tuple[int, Any]:
        """(row width, dtype) of an entry's rows in the arena."""
        return (1, torch.float32) if key == SCALES else (self.hidden, self.store_dtype)


def install_capture(
    worker, layer_ids: list[int], record_all: bool = False, handoff_prefix: str | None = None, fp8: bool = False
) -> dict:
    """Install forward hooks for ``layer_ids`` (absolute decoder-layer indices) on ``worker``.

    ``record_all`` keeps every forward's rows in step order (upstream's worker contract) instead
    of per announced request. ``handoff_prefix``: path prefix of the /dev/shm arena files (None:
    rows travel back pickled). ``fp8``: keep e4m3 rows and per-token scales (module docstring).
    """
    if fp8 and record_all:
        raise ValueError("FP8 states are kept per request; upstream's record-everything contract has none")
    old = getattr(worker, "_compat_capture", None)
    if old is not None:
        for h in old.handles:
            h.remove()
        if old.arena is not None:
            old.arena.close()
        worker._compat_capture = None
    runner = worker.model_runner
    model = runner.model
    base = find_base_model(model)
    n = len(base.layers)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        raise ValueError(
            f"layer ids {bad} out of range: the model has {n} decoder layers (0..{n - 1}; {n}: the final state "
            "after the norm)"
        )
    if n in layer_ids and (record_all or not isinstance(getattr(base, "norm", None), torch.nn.Module)):
        raise ValueError(f"the final state after the norm (id {n}) cannot be captured here")
    info = {
        "num_layers": n,
        "base_model": type(base).__name__,
        "model": type(model).__name__,
        "capturing": False,
        "runner": type(runner).__name__,
    }
    local = _moe_local_experts(model)
    if local is not None:  # on this rank: all experts under plain TP, a share under expert parallelism
        info["moe_local_experts"] = local
    kind = runner_kind(runner)
    info["runner_kind"] = kind
    stage = pipeline_stage()
    first, end = int(getattr(base, "start_layer", 0)), int(getattr(base, "end_layer", n))
    # the captured layers this stage computes (the final norm's on the last stage)
    own = [i for i in layer_ids if first <= i < end or (i == n and end == n)]
    info.update(stage=stage.rank, stages=stage.size, stage_layers=own, layer_range=[first, end])
    if stage.size > 1 and (record_all or fp8):
        raise ValueError(
            "pipeline parallelism: each stage captures its own layers, so per-step FP8 scales over "
            "every layer and upstream's record-everything contract cannot be kept by one worker"
        )
    _ensure_stage_buffer(runner, model, stage)
    # TP rank 0 of each stage that computes a captured layer, or the final layer (the self-check)
    capture_rank = stage.tp_rank == 0 and (bool(own) or stage.is_last)
    # the self-check runs on every rank of the last stage (its logits are gathered over the TP group)
    w = witness.install_witness(worker, model, base, capture_rank) if not record_all else "record-all contract"
    worker._compat_witness = w
    info["self_check"] = True if isinstance(w, witness.Witness) else w
    if not capture_rank:
        return info
    shared = handoff_prefix is not None and shares_driver_shm(handoff_prefix)
    prefix = None if not shared else handoff_prefix + (f"s{stage.rank}-" if stage.size > 1 else "")
    st = _CaptureState(layer_ids=own, record_all=record_all, runner_kind=kind, fp8=fp8, stage=stage.rank, final=n)
    mc = getattr(runner, "model_config", None)
    if mc is not None:
        st.hidden, st.dtype = int(mc.get_hidden_size()), mc.dtype
    on_gpu = next(model.parameters()).device.type == "cuda"
    st.arena = Arena(prefix, pin=on_gpu)
    worker._compat_capture = st
    _wrap_runner(runner, st)
    _install_hooks(st, runner, base, first, w)
    info["capturing"] = bool(own)
    info["handoff"] = "shm" if prefix else "rpc"
    info["states_dtype"] = "fp8" if fp8 else "auto"
    return info


def _install_hooks(st: _CaptureState, runner, base, first: int, w) -> None:
    """vLLM's @support_torch_compile replaces the decoder stack's __call__, so hooks on the stack
    itself never fire; its layers are plain modules. The first layer's pre-hook reads the step
    layout; once the last captured layer (or the final norm) ran, the rows are split by request."""
    st.handles.append(base.layers[first].register_forward_pre_hook(_make_pre_forward(runner, st), with_kwargs=True))
    distribute = _make_distribute(st)
    for lid in sorted(set(st.layer_ids)):
        module = base.norm if lid == st.final else base.layers[lid]
        st.handles.append(module.register_forward_hook(_make_layer_hook(st, lid, distribute)))
    # the self-check's rows: the arena's when it holds the final layer unquantized, else its own hook's
    if isinstance(w, witness.Witness) and (w.last not in st.layer_ids or st.fp8):  # (after the captured layers')
        st.handles.append(base.layers[w.last].register_forward_hook(witness.make_last_row_hook(st, w)))


def _moe_local_experts(model) -> int | None:
    """Routed experts held on this rank by the first fused-MoE layer, read from its expert weights
    (``w13_weight``, or ``w13_weight_packed`` when quantized: dim 0 is the local expert count in
    the 0.11, 0.12, 0.16, 0.17 and 0.32 sources); None for a dense model."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("w13_weight") and p.dim() >= 2:
            return int(p.shape[0])
    return None


def _wrap_runner(runner, st: _CaptureState) -> None:
    """Record each step's SchedulerOutput (how many tokens each request has in it) and, under Model
    Runner V2, the step's InputBatch (the order of its requests), on this runner instance.

    Not a registry patch: it wraps one object of our own engine (the model runner inside a worker
    that runs our extension), not a module-level target that other code shares, so there is
    nothing process-wide to apply on import or to restore on ``unpatch()``; it lives as long as
    that worker. It is marked with the registry's sentinel like every wrapper we put in place,
    and installing capture again reuses it."""
    from ..registry import SENTINEL

    runner._compat_state = st
    if getattr(runner.execute_model, SENTINEL, None) == "capture":
        return
    orig = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        cur = runner._compat_state
        # a V2 dummy run (profiling, warm-up) takes a made-up SchedulerOutput: nothing to capture
        cur.scheduler_output = None if kwargs.get("dummy_run") else scheduler_output
        cur.step_batch = None
        try:
            return orig(scheduler_output, *args, **kwargs)
        finally:
            cur.scheduler_output = None
            cur.step_batch = None

    execute_model.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(execute_model, SENTINEL, "capture")
    runner.execute_model = execute_model
    if st.runner_kind == "v2":
        orig_prepare = runner.prepare_inputs

        def prepare_inputs(*args, **kwargs):
            batch = orig_prepare(*args, **kwargs)
            runner._compat_state.step_batch = batch
            return batch

        prepare_inputs.__wrapped__ = orig_prepare  # type: ignore[attr-defined]
        setattr(prepare_inputs, SENTINEL, "capture")
        runner.prepare_inputs = prepare_inputs


def _make_pre_forward(runner, st: _CaptureState):
    def pre_forward(module, args, kwargs):
        st.layout = None
        st.plan = None
        st.rows = {}
        so = st.scheduler_output
        if so is None or not (st.expected or st.record_all):
            return None  # warm-up / profiling / dummy run, or nothing to capture
        step = step_requests(runner, st, so)
        if step is None:
            return None
        req_ids, counts, computed = step
        positions = kwargs.get("positions")  # decoder layers: forward(positions, hidden_states, ...)
        if positions is None and args:
            positions = args[0]
        if isinstance(positions, torch.Tensor) and positions.dim() == 1 and sum(counts):
            starts = step_starts(positions, counts, req_ids)
        else:  # M-RoPE style positions: fall back to the runner's computed-token counts
            if computed is None:
                raise RuntimeError(
                    "speculators_compat: the step has no 1-D positions and the runner's "
                    "input batch no computed-token counts: rows cannot be placed"
                )
            starts = [computed(i) for i in range(len(req_ids))]
        if st.fault is not None:  # (tests only: faults.py)
            req_ids = st.fault.layout(req_ids, counts, starts)
        st.layout = (req_ids, counts, starts)
        device = positions.device if isinstance(positions, torch.Tensor) else None
        if st.record_all:
            st.record_order = scheduler_order(req_ids, counts, so, device) if st.runner_kind == "v2" else None
        else:
            st.plan = plan_rows(st, req_ids, counts, starts, device)
            if st.fault is not None:
                st.plan = st.fault.plan(st.plan, device)
        return None

    return pre_forward


def _make_distribute(st: _CaptureState):
    def distribute():
        st.steps += 1
        if st.record_all:
            st.all_rows.append([st.rows[lid] for lid in sorted(set(st.layer_ids))])
        elif st.plan is not None:
            _, kept = st.plan
            for i, (rid, start, n, _row) in enumerate(kept):
                layers = [(*st.rows[key][i], n) for key in st.entries]  # where _store_rows put them
                st.segments.setdefault(rid, []).append(_Segment(start, layers))
                st.tokens += n
        st.rows = {}  # (the plan stays until the next forward: the self-check's hook reads it)

    return distribute


def take_captures(worker, req_ids: list[str], want_data: bool = True) -> dict:
    """Captures for ``req_ids``: {"states": {rid: [per layer]}, "errors": {rid: msg}, "arena": ...}.

    With a /dev/shm arena each layer is a list of (file, byte offset, rows) blocks in position
    order, for the driver to copy out; otherwise each layer is a tensor (pickled over the RPC).
    Forgets the requests afterwards (``want_data=False``: only that). Only the capturing rank
    returns data.
    """
    st = getattr(worker, "_compat_capture", None)
    if st is None:
        return {"states": {}, "errors": {}, "rank_captures": False}
    t0 = time.perf_counter()
    try:
        return _take(st, req_ids, want_data)
    finally:
        st.t_take += time.perf_counter() - t0


def _take(st, req_ids, want_data):
    _sync(st)
    flagged = bool(torch.stack(st.nonfinite).any()) if st.nonfinite else False
    st.nonfinite = []
    arena = st.arena
    states, errors = {}, {}
    for rid in req_ids:
        plen = st.expected.pop(rid, None)
        st.check_at.pop(rid, None)
        st.order.pop(rid, None)
        st.regions.pop(rid, None)
        segs = sorted(st.segments.pop(rid, []), key=lambda s: s.start)
        if not want_data:
            continue
        if plen is None:
            errors[rid] = "request was never announced to the worker"
            continue
        if not st.layer_ids:  # a last pipeline stage that computes no captured layer (the self-check's)
            states[rid] = []
            continue
        problem = coverage_problem([(s.start, s.layers[0][2]) for s in segs], plen)
        if problem is not None:
            errors[rid] = problem + " (prefix-cache hit, aborted request or lost step?)"
            continue
        if flagged and st.fp8:  # a NaN/Inf row makes its token's scale NaN/Inf
            if not all(
                bool(torch.isfinite(arena.view(b, o, n, 1, torch.float32)).all())
                for b, o, n in (s.layers[-1] for s in segs)
            ):
                errors[rid] = "NaN/Inf hidden states in a captured layer (its FP8 scale is not finite)"
                continue
        elif flagged:  # slow path, only when some row somewhere was not finite
            bad = [
                st.layer_ids[j]
                for j in range(len(st.layer_ids))
                if not all(
                    bool(torch.isfinite(arena.view(b, o, n, st.hidden, st.dtype)).all())
                    for b, o, n in (s.layers[j] for s in segs)
                )
            ]
            if bad:
                errors[rid] = f"NaN/Inf hidden states in layer(s) {bad}"
                continue
        shapes = [st.entry_shape(key) for key in st.entries]
        blocks = [merge_adjacent([s.layers[j] for s in segs], w * dt.itemsize) for j, (w, dt) in enumerate(shapes)]
        if arena.prefix is not None:
            states[rid] = [[(arena.path(b), o, n) for b, o, n in layer] for layer in blocks]
        else:
            states[rid] = [_gather(arena, layer, w, dt) for layer, (w, dt) in zip(blocks, shapes)]
    return {
        "states": states,
        "errors": errors,
        "rank_captures": True,
        "slabs": arena.paths(),
        "hidden": st.hidden,
        "dtype": str(st.store_dtype).replace("torch.", ""),
        "fp8": st.fp8,
        "layer_ids": st.layer_ids,
        "stage": st.stage,
    }


def trim(worker, req_id: str, length: int) -> None:
    """Keep ``req_id``'s first ``length`` positions: a request whose end was known only when it
    finished (one that keeps its output tokens) may have computed positions past it (a step
    scheduled before its stop was seen). ``take`` then checks coverage of exactly these."""
    st = getattr(worker, "_compat_capture", None)
    if st is None or req_id not in st.expected:
        return
    st.expected[req_id] = length
    kept = []
    for s in st.segments.get(req_id, []):
        if s.start >= length:
            continue
        keep = min(s.layers[0][2], length - s.start)
        kept.append(_Segment(s.start, [(b, o, keep) for b, o, _ in s.layers]))
    if req_id in st.segments:
        st.segments[req_id] = kept


def restart(worker, req_id: str) -> None:
    """``req_id`` is computed again from position 0 (resumed after a preemption): forget its rows."""
    st = getattr(worker, "_compat_capture", None)
    if st is not None:
        st.segments.pop(req_id, None)
    w = getattr(worker, "_compat_witness", None)
    if isinstance(w, witness.Witness):
        w.rows.pop(req_id, None)
        w.vllm_top.pop(req_id, None)


def _gather(arena, blocks, hidden, dtype) -> torch.Tensor:
    views = [arena.view(b, o, n, hidden, dtype) for b, o, n in blocks]
    return views[0].clone() if len(views) == 1 else torch.cat(views, dim=0)


def take_all_rows(worker):
    """Upstream's contract: one tensor per (sorted) layer, all rows since the last reset, step order."""
    st = getattr(worker, "_compat_capture", None)
    if st is None or not st.all_rows:
        return None
    _sync(st)
    out = [torch.cat([step[j] for step in st.all_rows], dim=0) for j in range(len(st.all_rows[0]))]
    st.all_rows = []
    st.nonfinite = []  # upstream's contract has no NaN check; don't let the flags pile up
    return out


def _sync(st: _CaptureState) -> None:
    if st.pending_event is not None:
        st.pending_event.synchronize()
        st.pending_event = None

"""Worker-side capture: runs inside every vLLM worker process, mixed into vLLM's ``Worker``.

vLLM mixes the class named by ``worker_extension_cls`` into its worker; our engine names
``speculators_compat.engine.worker.CaptureExtension`` and calls its ``compat_*`` methods through
``collective_rpc``. Nothing here depends on driver-side state: everything the capture needs is sent
with the calls (layer ids, expected prompt lengths).

How rows are attributed (the part upstream got wrong):
  * the engine tells the worker which request ids to expect and each one's prompt length;
  * every forward, the model runner's ``input_batch.req_ids`` gives the order of requests in the
    flattened token batch and the step's ``SchedulerOutput.num_scheduled_tokens`` how many tokens
    each contributes; the ``positions`` input gives each segment's token positions;
  * each segment is stored under (request id, start position); rows at positions >= the prompt
    length (a decode step) are dropped; nothing is ever attributed by offset across requests.
``take`` concatenates a request's segments by position and checks that every position
0..len-1 was captured exactly once.

Capture happens on tensor-parallel rank 0 only (after the row-parallel all-reduce every rank holds
the full hidden state, so one copy is enough); other ranks install nothing.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("speculators_compat.worker")

#: GPU -> host hand-off: "pinned" (async copies into pinned host memory, one sync per take) or "sync".
COPY_MODE_ENV = "SPECULATORS_COMPAT_COPY"


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


def _layer_output(output: Any) -> torch.Tensor:
    """The residual stream after a decoder layer: ``hidden_states + residual`` (pre final norm)."""
    if isinstance(output, tuple):
        hidden = output[0]
        residual = output[1] if len(output) > 1 else None
        if isinstance(residual, torch.Tensor):
            return hidden + residual
        return hidden
    return output


@dataclass
class _Segment:
    start: int
    layers: list  # one [n, hidden] tensor per captured layer (host memory, or pending async copy)


@dataclass
class _CaptureState:
    layer_ids: list[int]
    handles: list = field(default_factory=list)
    expected: dict = field(default_factory=dict)  # req_id -> prompt length
    segments: dict = field(default_factory=dict)  # req_id -> list[_Segment]
    scheduler_output: Any = None
    layout: Any = None  # (req_ids, counts, starts) of the current forward (positions checked)
    rows: dict = field(default_factory=dict)  # layer id -> tensor for the current forward
    copy_mode: str = "pinned"
    pending_event: Any = None
    record_all: bool = False
    all_rows: list = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    t_hooks: float = 0.0  # seconds inside capture hooks (device->host copies issued/done)
    t_take: float = 0.0  # seconds assembling and handing off in take()
    nonfinite: list = field(default_factory=list)  # device flags: did a step's layer hold NaN/Inf?


def install_capture(worker, layer_ids: list[int], record_all: bool = False, copy_mode: str | None = None) -> dict:
    """Install forward hooks for ``layer_ids`` (absolute decoder-layer indices) on ``worker``.

    ``record_all`` keeps every forward's rows in step order (upstream's worker contract) instead
    of per announced request.
    """
    old = getattr(worker, "_compat_capture", None)
    if old is not None:
        for h in old.handles:
            h.remove()
        worker._compat_capture = None
    runner = worker.model_runner
    model = runner.model
    base = find_base_model(model)
    n = len(base.layers)
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer ids {bad} out of range: the model has {n} decoder layers (0..{n - 1})")
    info = {"num_layers": n, "base_model": type(base).__name__, "model": type(model).__name__,
            "capturing": False, "runner": type(runner).__name__}
    if not hasattr(runner, "input_batch"):
        raise RuntimeError(
            f"speculators_compat: the model runner {type(runner).__name__} has no `input_batch` "
            "(vLLM Model Runner V2?). Capture needs the V1 runner: set VLLM_USE_V2_MODEL_RUNNER=0.")
    if not _is_capture_rank():
        return info
    mode = copy_mode or os.environ.get(COPY_MODE_ENV, "pinned")
    if mode not in ("pinned", "sync"):
        raise ValueError(f"{COPY_MODE_ENV} must be 'pinned' or 'sync', not {mode!r}")
    st = _CaptureState(layer_ids=list(layer_ids), copy_mode=mode, record_all=record_all)
    worker._compat_capture = st
    _wrap_runner(runner, st)
    # vLLM's @support_torch_compile replaces the decoder stack's __call__, so hooks on the stack
    # itself never fire; its layers are plain modules. The first layer's pre-hook reads the step
    # layout; once the last captured layer ran, the rows are split by request.
    first = getattr(base, "start_layer", 0)
    st.handles.append(base.layers[first].register_forward_pre_hook(_make_pre_forward(runner, st),
                                                                   with_kwargs=True))
    distribute = _make_distribute(st)
    for lid in sorted(set(layer_ids)):
        st.handles.append(base.layers[lid].register_forward_hook(_make_layer_hook(st, lid, distribute)))
    info["capturing"] = True
    return info


def _wrap_runner(runner, st: _CaptureState) -> None:
    # Record the SchedulerOutput of each step: it tells how many tokens each request has in it.
    runner._compat_state = st
    if getattr(runner, "_compat_wrapped", False):
        return
    orig = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        cur = runner._compat_state
        cur.scheduler_output = scheduler_output
        try:
            return orig(scheduler_output, *args, **kwargs)
        finally:
            cur.scheduler_output = None

    execute_model.__wrapped__ = orig  # type: ignore[attr-defined]
    runner.execute_model = execute_model
    runner._compat_wrapped = True


def _make_pre_forward(runner, st: _CaptureState):
    def pre_forward(module, args, kwargs):
        st.layout = None
        st.rows = {}
        so = st.scheduler_output
        if so is None or not (st.expected or st.record_all):
            return None  # warm-up / profiling / dummy run, or nothing to capture
        ib = runner.input_batch
        req_ids = list(ib.req_ids[: ib.num_reqs]) if hasattr(ib, "num_reqs") else list(ib.req_ids)
        counts = [int(so.num_scheduled_tokens.get(r, 0)) for r in req_ids]
        positions = kwargs.get("positions")  # decoder layers: forward(positions, hidden_states, ...)
        if positions is None and args:
            positions = args[0]
        total = sum(counts)
        if isinstance(positions, torch.Tensor) and positions.dim() == 1 and total:
            # one device->host copy per step; every check below runs on the host
            pos = positions[:total].to("cpu", non_blocking=False).long()
            cnt = torch.tensor(counts, dtype=torch.long)
            offsets = torch.cumsum(cnt, 0) - cnt
            starts_t = pos[offsets.clamp(max=total - 1)]
            expected = torch.repeat_interleave(starts_t, cnt) + torch.arange(total) - torch.repeat_interleave(offsets, cnt)
            if not torch.equal(pos, expected):
                bad_row = int((pos != expected).nonzero()[0])
                owner = int(torch.searchsorted(torch.cumsum(cnt, 0), bad_row, right=True))
                raise RuntimeError(
                    f"speculators_compat: request {req_ids[owner]}: positions of its rows are not "
                    "contiguous (attribution would be wrong)")
            starts = starts_t.tolist()
        else:  # M-RoPE style positions: fall back to the runner's computed-token counts
            starts = [int(ib.num_computed_tokens_cpu[i]) for i in range(len(req_ids))]
        st.layout = (req_ids, counts, starts)
        return None

    return pre_forward


def _make_distribute(st: _CaptureState):
    def distribute():
        req_ids, counts, starts = st.layout
        st.steps += 1
        if st.record_all:
            st.all_rows.append([st.rows[lid] for lid in sorted(set(st.layer_ids))])
        offset = 0
        for rid, n, start in zip(req_ids, counts, starts):
            plen = st.expected.get(rid)
            if n and plen is not None and start < plen:
                keep = min(n, plen - start)
                layers = [st.rows[lid][offset : offset + keep] for lid in st.layer_ids]
                st.segments.setdefault(rid, []).append(_Segment(start, layers))
                st.tokens += keep
            offset += n
        st.rows = {}
        st.layout = None

    return distribute


def take_captures(worker, req_ids: list[str], handoff_prefix: str | None = None) -> dict:
    """Assembled captures for ``req_ids``: {"states": {rid: [per layer]}, "errors": {rid: msg}}.

    With ``handoff_prefix`` (a path prefix on a filesystem the driver shares, /dev/shm), each
    (request, layer) tensor is written to its own file and only ``(path, shape, dtype)`` travels back
    over the RPC; otherwise the tensors themselves are pickled through vLLM's message queue (slow for
    hundreds of MB). Forgets the requests afterwards. Only the capturing rank returns data.
    """
    st = getattr(worker, "_compat_capture", None)
    if st is None:
        return {"states": {}, "errors": {}, "rank_captures": False}
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    # vLLM pins workers to one torch thread; the hand-off copy is memory-bound: use more
    torch.set_num_threads(max(threads, min(8, os.cpu_count() or 1)))
    try:
        return _take(st, req_ids, handoff_prefix)
    finally:
        torch.set_num_threads(threads)
        st.t_take += time.perf_counter() - t0


def _take(st, req_ids, handoff_prefix):
    _sync(st)
    flagged = bool(torch.stack(st.nonfinite).any()) if st.nonfinite else False
    st.nonfinite = []
    states, errors = {}, {}
    for rid in req_ids:
        plen = st.expected.pop(rid, None)
        segs = sorted(st.segments.pop(rid, []), key=lambda s: s.start)
        if plen is None:
            errors[rid] = "request was never announced to the worker"
            continue
        pos, problem = 0, None
        for s in segs:
            n = s.layers[0].shape[0]
            if s.start != pos:
                problem = (f"positions {pos}..{s.start - 1} missing" if s.start > pos
                           else f"positions {s.start}..{min(pos, s.start + n) - 1} captured twice")
                break
            pos += n
        if problem is None and pos != plen:
            problem = f"captured {pos} of {plen} prompt positions"
        if problem is not None:
            errors[rid] = problem + " (prefix-cache hit, aborted request or lost step?)"
            continue
        if flagged:  # slow path, only when some row somewhere was not finite
            bad = [st.layer_ids[j] for j in range(len(st.layer_ids))
                   if not all(bool(torch.isfinite(s.layers[j]).all()) for s in segs)]
            if bad:
                errors[rid] = f"NaN/Inf hidden states in layer(s) {bad}"
                continue
        if handoff_prefix is not None:
            states[rid] = [_write_shared(f"{handoff_prefix}{_uid(rid)}-{j}", [s.layers[j] for s in segs])
                           for j in range(len(st.layer_ids))]
        else:
            states[rid] = [torch.cat([s.layers[j] for s in segs], dim=0) if len(segs) > 1
                           # clone: a view would pickle its whole step's storage across the RPC
                           else segs[0].layers[j].clone() for j in range(len(st.layer_ids))]
    return {"states": states, "errors": errors, "rank_captures": True}


def _uid(rid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in rid)


def _write_shared(path: str, parts: list) -> tuple:
    """Concatenate ``parts`` (row blocks of one layer) into a new file at ``path``; return its descriptor."""
    rows = sum(p.shape[0] for p in parts)
    hidden = parts[0].shape[1]
    dtype = parts[0].dtype
    nbytes = rows * hidden * parts[0].element_size()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    dst = torch.from_file(path, shared=True, size=rows * hidden, dtype=dtype).view(rows, hidden)
    r = 0
    for p in parts:
        dst[r : r + p.shape[0]].copy_(p)
        r += p.shape[0]
    del dst  # unmap; the file keeps the data until the driver maps and unlinks it
    return ("file", path, (rows, hidden), str(dtype).replace("torch.", ""))


def take_all_rows(worker):
    """Upstream's contract: one tensor per (sorted) layer, all rows since the last reset, step order."""
    st = getattr(worker, "_compat_capture", None)
    if st is None or not st.all_rows:
        return None
    _sync(st)
    out = [torch.cat([step[j] for step in st.all_rows], dim=0) for j in range(len(st.all_rows[0]))]
    st.all_rows = []
    return out


def _sync(st: _CaptureState) -> None:
    if st.pending_event is not None:
        st.pending_event.synchronize()
        st.pending_event = None


class CaptureExtension:
    """Mixed into vLLM's Worker. Public surface: the ``compat_*`` methods (called via RPC)."""

    def compat_ping(self) -> str:
        return "speculators_compat"

    def compat_capture_setup(self, layer_ids: list[int], copy_mode: str | None = None) -> dict:
        return install_capture(self, layer_ids, copy_mode=copy_mode)

    def compat_capture_expect(self, expected: dict) -> None:
        """Announce request ids and their prompt lengths before they are scheduled."""
        st = getattr(self, "_compat_capture", None)
        if st is not None:
            st.expected.update(expected)

    def compat_capture_take(self, req_ids: list[str], handoff_prefix: str | None = None) -> dict:
        return take_captures(self, req_ids, handoff_prefix)

    def compat_capture_reset(self) -> None:
        st = getattr(self, "_compat_capture", None)
        if st is not None:
            st.expected.clear()
            st.segments.clear()
            st.all_rows = []

    def compat_capture_stats(self) -> dict:
        st = getattr(self, "_compat_capture", None)
        if st is None:
            return {}
        return {"steps": st.steps, "tokens": st.tokens, "pending_requests": len(st.segments),
                "copy_mode": st.copy_mode, "hook_s": round(st.t_hooks, 3), "take_s": round(st.t_take, 3)}


def _make_layer_hook(st: _CaptureState, lid: int, distribute):
    n_layers = len(set(st.layer_ids))

    def hook(module, args, output):
        if st.layout is None:
            return None
        t0 = time.perf_counter()
        total = sum(st.layout[1])
        out = _layer_output(output)[:total].detach()
        # NaN/Inf check where the data is hot: one reduction on the device, read once at take()
        st.nonfinite.append(~torch.isfinite(out).all())
        if out.device.type == "cpu":
            # A fresh tensor (hidden + residual) can be kept as is; the layer's own output buffer
            # may be updated in place by the next layer's fused add-norm, so copy that one.
            st.rows[lid] = out.clone() if out.data_ptr() == _first_ptr(output) else out
        elif st.copy_mode == "pinned":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            st.rows[lid] = host
            ev = torch.cuda.Event()
            ev.record()
            st.pending_event = ev
        else:
            st.rows[lid] = out.cpu()
        if len(st.rows) == n_layers:
            distribute()
        st.t_hooks += time.perf_counter() - t0
        return None

    return hook


def _first_ptr(output: Any) -> int:
    t = output[0] if isinstance(output, tuple) else output
    return t.data_ptr() if isinstance(t, torch.Tensor) else -1


def _is_capture_rank() -> bool:
    try:
        from vllm.distributed import get_pp_group, get_tp_group
    except ImportError:  # pragma: no cover - only outside vLLM
        return True
    return get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank

"""The self-check, worker side: the logits our captured states imply, for the driver to set against
the token vLLM sampled (engine/selfcheck.py judges).

vLLM samples each request's one token from the logits at its last prompt position. Every batch,
the capturing rank takes OUR state of the final decoder layer at each request's last position (the
arena's row when the last layer is captured unquantized, else one row kept for this check by a hook
on that layer, placed by the same plan as every captured row), and all tensor-parallel ranks apply the
model's own final norm and ``compute_logits`` to it (rank 0 broadcasts the rows; the logits are
gathered over the TP group as vLLM gathers them). Rank 0 hands back the top logits of each request.
A state that belongs to another request or position, or is zeros, implies another token.

It runs inside ``compat_capture_take``, after the batch's last step and before its rows are handed
over, on every rank (the gather is a collective: every rank must take part, so no rank skips it,
whatever went wrong on rank 0).

Tests make the capture itself wrong in the worker (faults.py) to show that the check fails.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("speculators_compat.worker")

TOP_K = 8  # logits handed back per request: enough to place a near-tie and size a gap


@dataclass
class Witness:
    model: Any  # the runner's model: its compute_logits is the one vLLM calls
    norm: Any  # the decoder stack's final norm
    last: int  # the final decoder layer's index
    hidden: int
    dtype: Any
    device: Any
    capture: bool  # this rank holds the captured rows (TP rank 0)
    tp: Any  # vLLM's tensor-parallel group, None at TP=1
    rows: dict = field(default_factory=dict)  # req_id -> [hidden] kept by the last layer's hook
    enabled: bool = True  # the driver's setting (compat_self_check): off, the hook keeps nothing
    seconds: float = 0.0  # time in check()
    vllm_top: dict = field(default_factory=dict)  # req_id -> (ids, log-probabilities): vLLM's own (watch_logits)
    checking: bool = False  # inside check(): its compute_logits call is ours, not vLLM's


def target(st, rid) -> int | None:
    """One past the position whose state the check sets against the sampled token: the prompt's
    end (``check_at`` where the capture keeps more than the prompt)."""
    return st.check_at.get(rid) or st.expected.get(rid)


def install_witness(worker, model, base, capture: bool):
    """A Witness for this worker, a string saying why the check cannot run here, or None on a
    pipeline stage before the last (the final norm and lm_head live on the last stage: it checks)."""
    try:
        from vllm.distributed import get_pp_group, get_tp_group
    except ImportError:  # pragma: no cover - only outside vLLM
        tp, last_stage = None, True
    else:
        tp, last_stage = get_tp_group(), get_pp_group().is_last_rank
    if not last_stage:
        return None
    norm = getattr(base, "norm", None)
    if not isinstance(norm, torch.nn.Module) or not callable(getattr(model, "compute_logits", None)):
        return f"no final norm (`{type(base).__name__}.norm`) or compute_logits on {type(model).__name__}"
    p = next(norm.parameters(), None)
    if p is None:
        p = next(model.parameters())
    mc = getattr(worker.model_runner, "model_config", None)
    hidden = int(mc.get_hidden_size()) if mc is not None else int(p.shape[-1])
    dtype = mc.dtype if mc is not None else p.dtype
    last = int(getattr(base, "end_layer", len(base.layers))) - 1
    tp = tp if tp is not None and tp.world_size > 1 else None
    return Witness(model, norm, last, hidden, dtype, p.device, capture, tp)


def make_last_row_hook(st, w: Witness):
    """A forward hook for the final layer, when it is not captured: keeps the row at each request's
    last prompt position, for the requests this step's plan kept rows of, at their places in the
    step's layout (the attribution every captured layer used)."""

    def hook(module, args, output):
        plan, layout = st.plan, st.layout
        if plan is None or layout is None or not w.enabled:
            return None
        req_ids, counts, _ = layout
        offsets, at = {}, 0  # each request's first row in the step (the plan's entries start there)
        for rid, n in zip(req_ids, counts):
            offsets[rid] = at
            at += n
        pick = []
        for rid, start, n, _ in plan[1]:
            end = target(st, rid)
            if end is not None and start < end <= start + n:
                pick.append((rid, offsets[rid] + end - 1 - start))
        if not pick:
            return None
        if st.fault is not None:  # (tests only: faults.py)
            pick = st.fault.last_rows(pick)
        hidden = output[0] if isinstance(output, tuple) else output
        residual = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        # views of single rows, stacked: one kernel, no index tensor to send to the device
        h = torch.stack([hidden[r] for _, r in pick])
        if isinstance(residual, torch.Tensor):
            h = h + torch.stack([residual[r] for _, r in pick])
        if st.fault is not None:
            h, _ = st.fault.rows(h, None)
        for (rid, _), row in zip(pick, h):
            w.rows[rid] = row
        return None

    return hook


def _state_rows(st, w: Witness, req_ids) -> tuple[torch.Tensor, list[str | None]]:
    """[requests, hidden] on the model's device: our final-layer state at each last position."""
    # (FP8: the arena's rows are quantized; the hook kept the unquantized one)
    j = st.layer_ids.index(w.last) if w.last in st.layer_ids and not st.fp8 else None
    where = w.device if j is None else "cpu"  # the hook's rows are on the device, the arena's on the host
    rows, problems = [], []
    for rid in req_ids:
        end = target(st, rid)
        row = None
        if j is None:
            row = w.rows.pop(rid, None)
        elif end is not None:
            for s in st.segments.get(rid, ()):
                b, o, n = s.layers[j]
                if s.start < end <= s.start + n:
                    row = st.arena.view(b, o, n, st.hidden, st.dtype)[end - 1 - s.start]
                    break
        problems.append(None if row is not None else "no captured state at its last position")
        rows.append(row if row is not None else torch.zeros(w.hidden, dtype=w.dtype, device=where))
    return torch.stack(rows).to(w.device), problems  # (arena rows: stacked on the host, one copy)


def check(worker, req_ids: list[str], probe: list[list[int]] | None = None) -> dict | None:
    """Every rank: the final norm and compute_logits on our last-position states. Rank 0 returns
    {"ids": [[top token ids]], "logits": [[their logits]], "zero": [...], "problems": [...],
    "logprobs": [[ours at probe[i]'s ids]] or None, "seconds": s}, one entry a request in
    ``req_ids`` order; other ranks None. ``probe``: per request, the token ids whose log-probability
    vLLM reported (its sampled token and its top ones): ours at the same ids come back."""
    w = getattr(worker, "_compat_witness", None)
    if not isinstance(w, Witness):
        return None
    t0 = time.perf_counter()
    st = getattr(worker, "_compat_capture", None)
    rows, problems = None, [None] * len(req_ids)
    if w.capture and st is not None:
        try:
            if st.pending_event is not None:  # the last step's device->host copies
                st.pending_event.synchronize()
                st.pending_event = None
            rows, problems = _state_rows(st, w, req_ids)
        except Exception as e:  # still take part in the collective below, or the other ranks hang
            logger.error("speculators_compat: self-check could not gather the states: %s", e)
            problems = [f"self-check could not gather the states: {e}"] * len(req_ids)
            rows = None
    if rows is None:
        rows = torch.zeros(len(req_ids), w.hidden, dtype=w.dtype, device=w.device)
    with torch.inference_mode():
        if w.tp is not None:
            rows = w.tp.broadcast(rows, src=0)
        normed = w.norm.forward(rows)  # (not __call__: a capture hook on the norm must not see these rows)
        if isinstance(normed, tuple):
            normed = normed[0]
        w.checking = True
        try:
            logits = w.model.compute_logits(normed)
        finally:
            w.checking = False
        if not w.capture or logits is None:
            w.seconds += time.perf_counter() - t0
            return None
        logits = logits.float()  # (vLLM's sampler takes its log-probabilities in float32 too)
        vals, ids = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1)
        zero = rows.abs().amax(dim=-1) == 0
        parts = [ids.double(), vals.double(), zero.double()[:, None]]
        width = max((len(p) for p in probe or ()), default=0)
        if width:
            at = torch.tensor([p + [0] * (width - len(p)) for p in probe], device=logits.device)
            parts.append((logits.gather(1, at) - logits.logsumexp(dim=-1, keepdim=True)).double())
        # one device->host copy (float64 holds every token id exactly)
        both = torch.cat(parts, dim=1).cpu()
        k = ids.shape[1]
        out = {
            "ids": both[:, :k].long().tolist(),
            "logits": both[:, k : 2 * k].tolist(),
            "zero": both[:, 2 * k].bool().tolist(),
            "problems": problems,
            "logprobs": [r[: len(p)] for r, p in zip(both[:, 2 * k + 1 :].tolist(), probe)] if width else None,
        }
    w.seconds += time.perf_counter() - t0
    out["seconds"] = w.seconds
    return out


def forget(worker, req_ids) -> None:
    w = getattr(worker, "_compat_witness", None)
    if isinstance(w, Witness):
        for rid in req_ids:
            w.rows.pop(rid, None)
            w.vllm_top.pop(rid, None)


def watch_logits(worker) -> bool:
    """Keep vLLM's own log-probabilities at each captured request's checked position: where the
    sampling parameters are the client's (a server), the sampled token is no argmax, so the check
    sets ours against the distribution vLLM sampled from. Wraps this worker's ``compute_logits``
    (the capturing rank of the last stage): the logits of a step come one row a request, in the
    step's order (the order every row of the step was attributed by). Returns whether it watches."""
    w = getattr(worker, "_compat_witness", None)
    st = getattr(worker, "_compat_capture", None)
    if not isinstance(w, Witness) or not w.capture or st is None:
        return False
    orig = w.model.compute_logits
    if getattr(orig, "__wrapped__", None) is not None:
        return True

    def compute_logits(hidden_states, *args, **kwargs):
        logits = orig(hidden_states, *args, **kwargs)
        if not w.checking and logits is not None and st.layout is not None:
            _keep_vllm_top(w, st, logits)
        return logits

    compute_logits.__wrapped__ = orig  # type: ignore[attr-defined]
    w.model.compute_logits = compute_logits
    return True


def _keep_vllm_top(w: Witness, st, logits) -> None:
    req_ids, counts, starts = st.layout
    rows = [i for i, rid in enumerate(req_ids) if counts[i] and st.check_at.get(rid)]
    if logits.shape[0] != len(req_ids) or not rows:
        return  # (not one row a request: a step this check cannot read; the request then fails its check)
    # (the logits row of a request is at its last position in the step)
    pick = [i for i in rows if starts[i] + counts[i] == st.check_at[req_ids[i]]]
    if not pick:
        return
    with torch.inference_mode():
        lp = logits[pick].float().log_softmax(dim=-1)
        vals, ids = lp.topk(min(TOP_K, lp.shape[-1]), dim=-1)
        ids, vals = ids.cpu().tolist(), vals.cpu().tolist()
    for i, a, b in zip(pick, ids, vals):
        w.vllm_top[req_ids[i]] = (a, b)

"""How a step's rows reach the arena, inside each capturing worker: each captured layer's forward
hook writes the rows the step's plan keeps (``hidden_states + residual``; the final norm's output as
it is) to their requests' regions, by one asynchronous copy a run on a GPU; FP8 states are
quantized per token once the step's last captured layer ran (capture.py's module docstring).
``st`` is capture.py's per-worker ``_CaptureState``."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from . import fp8 as fp8_mod

SCALES = "scales"  # the region / entry key of a request's per-token FP8 scales


def _layer_output(output: Any) -> torch.Tensor:
    """The residual stream after a decoder layer: ``hidden_states + residual`` (pre final norm)."""
    if isinstance(output, tuple):
        hidden = output[0]
        residual = output[1] if len(output) > 1 else None
        if isinstance(residual, torch.Tensor):
            return hidden + residual
        return hidden
    return output


def _make_layer_hook(st, lid: int, distribute):
    n_layers = len(set(st.layer_ids))

    def hook(module, args, output):
        if st.layout is None:
            return None
        t0 = time.perf_counter()
        if st.record_all:
            st.rows[lid] = _record_rows(st, output)
        elif st.plan is not None:
            st.rows[lid] = _store_rows(st, output, lid)
        if len(st.rows) == n_layers or (st.plan is None and not st.record_all):  # step done, or nothing to keep
            if st.fp8 and st.plan is not None:
                _quantize_step(st)
            distribute()
        st.t_hooks += time.perf_counter() - t0
        return None

    return hook


def _store_rows(st, output: Any, lid: int) -> list[tuple[int, int]] | None:
    """Write this forward's kept rows of layer ``lid`` into the arena; returns (buffer, byte
    offset) for each kept entry of the plan, in its order. FP8: the rows are kept on the device
    for ``_quantize_step`` instead (None)."""
    source, _ = st.plan
    if isinstance(output, tuple):  # (the final norm's second output is the sum it normed: not added)
        hidden, residual = output[0], (output[1] if len(output) > 1 and lid != st.final else None)
        if not isinstance(residual, torch.Tensor):
            residual = None
    else:
        hidden, residual = output, None
    pick = (lambda t: t[source]) if isinstance(source, slice) else (lambda t: t.index_select(0, source))
    h = pick(hidden.detach())
    if st.fault is not None:  # (tests only: faults.py)
        h, residual = st.fault.rows(h, residual)
    if st.dtype is None or h.shape[-1] != st.hidden or h.dtype != st.dtype:  # first capture defines them
        st.hidden, st.dtype = int(h.shape[-1]), h.dtype
    if h.device.type == "cpu" and not st.fp8:
        # one pass: the residual stream (hidden + residual) lands in the arena directly
        dests, runs = _destinations(st, lid, st.row_bytes)
        res = pick(residual.detach()) if residual is not None else None
        for b, off, row, n in runs:
            dst = st.arena.view(b, off, n, st.hidden, st.dtype)
            if res is not None:
                torch.add(h[row : row + n], res[row : row + n], out=dst)
            else:
                dst.copy_(h[row : row + n])
            st.nonfinite.append(_nonfinite_flag(dst))
        return dests
    if residual is not None:
        val = h + pick(residual.detach())
    elif isinstance(source, slice):  # a view of the layer output, which later layers may
        val = h.clone()  # update in place while the copy below is in flight
    else:
        val = h  # index_select made it
    # NaN/Inf check where the data is hot: one reduction on the device, read once at take()
    st.nonfinite.append(_nonfinite_flag(val))
    if st.fp8:
        st.pending[lid] = val
        return None
    dests, runs = _destinations(st, lid, st.row_bytes)
    _write_runs(st, runs, val, st.hidden, st.dtype)
    return dests


def _quantize_step(st) -> None:
    """FP8: every captured layer's kept rows of this step are in; quantize them per token, on
    their device, and write the e4m3 rows and the scales into the arena. On a GPU this runs on the
    side stream of the copies, so the forward's remaining layers do not queue behind it."""
    lids = sorted(st.pending)
    vals = [st.pending.pop(lid) for lid in lids]
    with _on_side_stream(st, vals):
        _quantize_into_arena(st, lids, vals)


def _quantize_into_arena(st, lids: list, vals: list) -> None:
    rows, scales = fp8_mod.quantize_rows(vals)
    for lid, q in zip(lids, rows):
        dests, runs = _destinations(st, lid, st.row_bytes)
        _write_runs(st, runs, q, st.hidden, q.dtype)
        st.rows[lid] = dests
    dests, runs = _destinations(st, SCALES, scales.element_size())
    _write_runs(st, runs, scales[:, None], 1, scales.dtype)
    st.rows[SCALES] = dests


@contextlib.contextmanager
def _on_side_stream(st, vals: list):
    """Run the block on ``st``'s copy stream, after the compute stream's work so far (which made
    ``vals``); ``record_stream`` keeps ``vals``' memory from reuse until the side stream is done
    with them. Host tensors: the block runs as it is."""
    if not vals or vals[0].device.type != "cuda":
        yield
        return
    side = _side_stream(st, vals[0].device)
    side.wait_stream(torch.cuda.current_stream(vals[0].device))
    for v in vals:
        v.record_stream(side)
    with torch.cuda.stream(side):
        yield


def _destinations(st, key, row_bytes: int) -> tuple[list, list]:
    """Where the plan's kept entries of ``key`` (a layer id, or SCALES) go: (buffer, byte offset)
    per entry, and the copies to make, [buffer, byte offset, first source row, rows] for each run
    of entries adjacent both in the step and in the arena.

    Rows go to their requests' regions; a step with an entry that has none (the rows' size
    differs from the one the regions were sized with, or no region was made) goes into one
    fresh block, as one copy."""
    _, kept = st.plan
    places = [st.regions.get(rid, {}).get(key) for rid, _, _, _ in kept]
    if st.row_bytes == st.region_row_bytes and all(p is not None for p in places):
        dests = [(b, off + start * row_bytes) for (b, off), (_, start, _, _) in zip(places, kept)]
    else:
        b, off = st.arena.alloc((kept[-1][3] + kept[-1][2]) * row_bytes)
        dests = [(b, off + row * row_bytes) for _, _, _, row in kept]
    runs = []
    for (b, off), (_, _, n, row) in zip(dests, kept):
        last = runs[-1] if runs else None
        if last and last[0] == b and last[1] + last[3] * row_bytes == off and last[2] + last[3] == row:
            last[3] += n
        else:
            runs.append([b, off, row, n])
    return dests, runs


def _write_runs(st, runs: list, val: torch.Tensor, width: int, dtype) -> None:
    """Copy ``val``'s rows into the arena as ``runs`` say (an asynchronous DMA into pinned slabs)."""
    for b, off, row, n in runs:
        dst = st.arena.view(b, off, n, width, dtype)
        if val.device.type != "cpu" and st.arena.pinned(b):
            _copy_on_side_stream(st, dst, val[row : row + n])
        else:
            dst.copy_(val[row : row + n])


def _copy_on_side_stream(st, dst: torch.Tensor, val: torch.Tensor) -> None:
    """Device->host DMA of ``val`` on a side stream, so the forward's next kernels do not queue
    behind it (on the compute stream they held a measurable share of a batch up: docs/benchmarks.md).
    The side stream waits for ``val`` to be computed; ``record_stream`` keeps
    its memory from being reused until the copy is done; take() waits for the last copy."""
    side = _side_stream(st, val.device)
    side.wait_stream(torch.cuda.current_stream(val.device))
    with torch.cuda.stream(side):
        dst.copy_(val, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
    val.record_stream(side)
    st.pending_event = ev


def _side_stream(st, device):
    if st.copy_stream is None:
        st.copy_stream = torch.cuda.Stream(device=device)
    return st.copy_stream


def _nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: might ``t`` hold NaN/Inf? One float32 sum, no boolean mask: any NaN or Inf makes
    the sum non-finite, so nothing is missed; a finite sum that overflows (|values| ~1e38) only sends
    take() down its exact per-request check."""
    return ~torch.isfinite(t.sum(dtype=torch.float32))


def _record_rows(st, output: Any) -> torch.Tensor:
    """All rows of this forward as a host tensor of its own (upstream's record-everything contract)."""
    total = sum(st.layout[1])
    out = _layer_output(output)[:total].detach()
    if st.record_order is not None:
        out = out.index_select(0, st.record_order)  # a new tensor, in the scheduler's order
    st.nonfinite.append(~torch.isfinite(out).all())
    if out.device.type == "cpu":
        # hidden + residual is a fresh tensor; a bare layer output may be updated in place later
        return out.clone() if out.data_ptr() == _first_ptr(output) else out
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)  # an asynchronous copy, waited for in take
    host.copy_(out, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    st.pending_event = ev
    return host


def _first_ptr(output: Any) -> int:
    t = output[0] if isinstance(output, tuple) else output
    return t.data_ptr() if isinstance(t, torch.Tensor) else -1

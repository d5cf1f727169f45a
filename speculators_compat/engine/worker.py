"""Worker-side capture: runs inside every vLLM worker process, mixed into vLLM's ``Worker``.

vLLM mixes the class named by ``worker_extension_cls`` into its worker; our engine names
``speculators_compat.engine.worker.CaptureExtension`` and calls its ``compat_*`` methods through
``collective_rpc``. Nothing here depends on driver-side state: everything the capture needs is sent
with the calls (layer ids, expected prompt lengths).

How rows are attributed (the part upstream got wrong):
  * the engine tells the worker which request ids to expect and each one's prompt length;
  * every forward, the model runner gives the order of requests in the flattened token batch (the
    V1 runner: its persistent ``input_batch.req_ids``; Model Runner V2, the only one from vLLM 0.34:
    the ``InputBatch`` its ``prepare_inputs`` builds for the step, requests sorted by token count)
    and the step's ``SchedulerOutput.num_scheduled_tokens`` how many tokens each contributes; the
    ``positions`` input gives each segment's token positions;
  * each segment is stored under (request id, start position); rows at positions >= the prompt
    length (a decode step) are dropped; nothing is ever attributed by offset across requests.
``take`` orders a request's segments by position and checks that every position 0..len-1 was
captured exactly once.

Where the rows go: the hooks write each step's kept rows straight into a host arena slab (a file
in /dev/shm the driver maps; on a GPU it is registered as pinned memory, so the device->host copy
is an asynchronous DMA). When a batch is announced, each request gets its own region of the slab
per captured layer, sized to its prompt, in announcement order, and every step's rows land at
their positions in it: a prompt that the scheduler splits over several steps still ends up as one
block, and requests scheduled in announcement order make one run (one DMA) per layer and step.
``take`` copies nothing: it hands back (file, offset, rows) blocks, adjacent ones merged. The
driver lends single-block rows to its caller as tensors over its mapping (no copy) and copies the
rest (rows that fell back to per-step blocks); every batch it tells the worker which slabs still
hold lent rows, and a new batch is written only into a slab that holds none (or a new one). Free
slabs are reused, so in a loop that drops each batch's results the arena stays at a few batches'
states.

Capture happens on tensor-parallel rank 0 only (after the row-parallel all-reduce every rank holds
the full hidden state, so one copy is enough); other ranks take part only in the self-check
(witness.py), whose logits are gathered over the tensor-parallel group.
"""

from __future__ import annotations

import logging
import time

from . import witness
from .arena import SHM_ALIGN
from .capture import SCALES, install_capture, take_captures

logger = logging.getLogger("speculators_compat.worker")


def _live_slabs(st) -> set:
    """The arena slabs some announced request's rows or regions are in."""
    live = {b for places in st.regions.values() for b, _ in places.values()}
    live.update(b for segs in st.segments.values() for s in segs for b, _, _ in s.layers)
    return live


class CaptureExtension:
    """Mixed into vLLM's Worker. Public surface: the ``compat_*`` methods (called via RPC)."""

    def compat_ping(self) -> str:
        return "speculators_compat"

    def compat_capture_setup(self, layer_ids: list[int], handoff_prefix: str | None = None, fp8: bool = False) -> dict:
        return install_capture(self, layer_ids, handoff_prefix=handoff_prefix, fp8=fp8)

    def compat_capture_expect(self, expected: dict, busy=(), slabs: int | None = None) -> None:
        """Announce request ids and their prompt lengths before they are scheduled; size the arena.
        ``busy``: arena files the driver still lends out (tensors its caller holds): never refilled.
        ``slabs``: how many batches' rows the caller will hold at once (None: as before)."""
        st = getattr(self, "_compat_capture", None)
        if st is None:
            return
        t0 = time.perf_counter()
        need = 0
        keys = [*sorted(set(st.layer_ids)), *([SCALES] if st.fp8 else [])]  # one region each a request
        if st.hidden and st.dtype is not None:
            rows = sum(expected.values())
            per_row = sum(w * dt.itemsize for w, dt in map(st.entry_shape, keys))
            # kept rows + per-block alignment for up to one block per (request, entry, step)
            need = rows * per_row + len(keys) * SHM_ALIGN * (len(expected) + 8)
        # before accepting the batch: a failure (no room) leaves no trace
        if not st.segments and not st.regions:  # every earlier batch was taken: a new one in a free slab
            st.arena.prepare(need, busy, slabs)
        else:  # (rows of requests still in flight: continuous batching keeps the slabs they are in)
            st.arena.reserve(need, _live_slabs(st), busy)
        if need and not st.record_all:
            # each request's rows per entry: one region in announcement order, entry by entry, so
            # requests that run in that order are adjacent
            st.region_row_bytes = st.row_bytes
            for key in keys:
                width, dtype = st.entry_shape(key)
                for rid, plen in expected.items():
                    if rid not in st.expected and plen > 0:
                        st.regions.setdefault(rid, {})[key] = st.arena.alloc(plen * width * dtype.itemsize)
        for rid in expected:
            if rid not in st.order:
                st.order[rid] = st.serial
                st.serial += 1
        st.expected.update(expected)
        st.t_expect += time.perf_counter() - t0

    def compat_capture_take(
        self, req_ids: list[str], want_data: bool = True, self_check: bool = False, probe: list | None = None
    ) -> dict:
        """The batch's rows (see take_captures); with ``self_check``, first the logits our states
        imply at each last position, and our log-probabilities at ``probe``'s token ids (witness.py:
        every rank takes part)."""
        verdict = witness.check(self, req_ids, probe) if self_check and want_data else None
        witness.forget(self, req_ids)
        taken = take_captures(self, req_ids, want_data)
        if verdict is not None:
            taken["self_check"] = verdict
        return taken

    def compat_release_node(self) -> bool:
        """The driver's engine is shutting down: a worker on another host than the driver's (node
        rank >= 1, node.py) exits once this reply is sent, so that host's ``node`` command ends too
        (the driver's executor ends only the workers on its own host)."""
        pc = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        if pc is None or int(getattr(pc, "node_rank", 0) or 0) == 0:
            return False
        import os
        import threading

        threading.Timer(0.5, os._exit, args=(0,)).start()
        return True

    def compat_self_check(self, on: bool) -> None:
        """The driver's self-check setting: off, the final layer's hook keeps no rows."""
        w = getattr(self, "_compat_witness", None)
        if isinstance(w, witness.Witness):
            w.enabled = bool(on)
            w.rows.clear()

    def compat_inject_fault(self, kind: str | None) -> None:
        """Tests only: make the capture wrong on purpose (faults.py)."""
        from .faults import inject_fault

        inject_fault(self, kind)

    def compat_capture_reset(self) -> None:
        st = getattr(self, "_compat_capture", None)
        if st is not None:
            st.expected.clear()
            st.check_at.clear()
            st.order.clear()
            st.segments.clear()
            st.regions.clear()
            st.pending.clear()
            st.all_rows = []
        w = getattr(self, "_compat_witness", None)
        if isinstance(w, witness.Witness):
            w.rows.clear()

    def compat_capture_stats(self) -> dict:
        st = getattr(self, "_compat_capture", None)
        if st is None:
            return {}
        return {
            "steps": st.steps,
            "tokens": st.tokens,
            "pending_requests": len(st.segments),
            "hook_s": round(st.t_hooks, 3),
            "take_s": round(st.t_take, 3),
            "worker_expect_s": round(st.t_expect, 4),
            "arena_bytes": st.arena.total_bytes if st.arena else 0,
            "arena_slabs": len(st.arena.slabs) if st.arena else 0,
            "arena_slabs_made": st.arena._n if st.arena else 0,
            "arena_new_s": round(st.arena.t_new, 4) if st.arena else 0.0,
            "arena_want": st.arena.want if st.arena else 0,
            "self_check_s": round(getattr(getattr(self, "_compat_witness", None), "seconds", 0.0), 4),
        }  # (each one allocated, page-locked on a GPU)

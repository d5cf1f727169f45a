"""Continuous batching over the one engine: prompts join the running EngineCore between steps, and
each comes back alone as soon as its own rows are taken (a server's engine loop: serve/).

One thread owns the engine. Each turn it
  1. admits the prompts submitted since the last turn: announces them to the workers (their
     prompt lengths: arena regions) and adds one ``max_tokens=1`` request each to the EngineCore;
  2. steps the EngineCore once (chunked prefill, the async batch queue: vLLM's own scheduling);
  3. takes the requests that got their one sampled token: their rows (copied out of the arena),
     the coverage and NaN/Inf verdicts and the self-check, each request judged alone, so one bad
     request fails only its own future.
Attribution is by request id and position, as in ``ExtractionEngine.run``. A failure of the engine
itself (a worker died, an RPC failed) fails every pending future and marks the loop dead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..errors import CaptureError
from .selfcheck import first_logprobs, judge

logger = logging.getLogger("speculators_compat.engine")

IDLE_WAIT_S = 0.05  # how long an idle loop waits for a prompt before looking again


@dataclass
class Captured:
    """One prompt's result: its states (a tensor per layer, or fp8.Fp8States) and the token sampled."""

    states: Any
    token: int


@dataclass
class _Pending:
    prompt: list[int]
    future: Future
    sampled: tuple | None = None
    t_submit: float = field(default_factory=time.monotonic)


class EngineDead(RuntimeError):
    """The engine under the loop failed: no prompt can be served any more."""


class StreamingLoop:
    """Owns ``engine`` (an ExtractionEngine) on a thread of its own; ``submit`` from any thread."""

    def __init__(self, engine, max_waiting: int = 4096):
        self.engine = engine
        engine._reader.lend = False  # (each result is copied out: the arena is reused at once)
        self._inbox: queue.Queue = queue.Queue(max_waiting)
        self._pending: dict[str, _Pending] = {}
        self._serial = 0
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self.served = 0
        self._thread = threading.Thread(target=self._main, name="sc-engine-loop", daemon=True)
        self._thread.start()

    # -- callers ----------------------------------------------------------------------------------
    def submit(self, prompt: list[int]) -> Future:
        """A future of ``Captured`` for one prompt (token ids already checked by the caller)."""
        fut: Future = Future()
        if self.dead is not None:
            fut.set_exception(EngineDead(f"the engine failed: {self.dead}"))
            return fut
        self._inbox.put((list(prompt), fut))
        return fut

    @property
    def in_flight(self) -> int:
        return len(self._pending) + self._inbox.qsize()

    def close(self, drain_s: float = 0.0) -> None:
        """Stop the loop: with ``drain_s``, first wait up to that long for what is in flight."""
        deadline = time.monotonic() + drain_s
        while self.in_flight and time.monotonic() < deadline and self.dead is None:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=30)
        self._fail_all(EngineDead("the server is shutting down"))

    # -- the loop -------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self._busy()
                self._admit(wait=idle)
                if self._busy():
                    self._step()
                    self._take_finished()
                elif idle and self.engine._worker_died(0.0):  # (seen while idle too: /health says so)
                    raise EngineDead("a vLLM worker process died")
        except BaseException as e:  # the engine is gone: every caller hears why
            self.dead = e
            logger.error("speculators_compat: the engine loop failed: %s", e)
            self._fail_all(EngineDead(f"the engine failed: {e}"))

    def _busy(self) -> bool:
        core = self.engine.core
        return (
            bool(self._pending)
            or core.scheduler.has_unfinished_requests()
            or bool(getattr(core, "batch_queue", None) or ())
        )

    def _admit(self, wait: bool) -> None:
        new = []
        try:
            if wait:
                new.append(self._inbox.get(timeout=IDLE_WAIT_S))
            while True:
                new.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        new = [(p, f) for p, f in new if f.set_running_or_notify_cancel()]
        if not new:
            return
        eng = self.engine
        ids = []
        for p, f in new:
            self._serial += 1
            rid = f"sc-{eng._uid}-s{self._serial}"
            self._pending[rid] = _Pending(p, f)
            ids.append(rid)
        eng.executor.collective_rpc(
            "compat_capture_expect", args=({r: len(self._pending[r].prompt) for r in ids}, (), 0)
        )
        check = eng.self_check
        for rid in ids:
            eng.core.add_request(eng._make_request(rid, self._pending[rid].prompt, check))

    def _step(self) -> None:
        outputs, _ = self.engine.core.step_fn()
        for batch in (outputs or {}).values():
            for o in batch.outputs:
                p = self._pending.get(o.request_id)
                if p is not None and p.sampled is None and o.new_token_ids:
                    p.sampled = (o.new_token_ids[0], *first_logprobs(o.new_logprobs))

    def _take_finished(self) -> None:
        done = [r for r, p in self._pending.items() if p.sampled is not None]
        if not done:
            return
        eng = self.engine
        check = eng.self_check
        probe = [list(self._pending[r].sampled[1]) for r in done] if check else None
        taken = eng.take_batch(done, check, probe)
        sampled = {r: self._pending[r].sampled for r in done}
        for i, rid in enumerate(done):
            p = self._pending.pop(rid)
            err = taken["errors"].get(rid)
            if err is None and check:
                err = _self_check_problem(taken["self_check"], i, rid, sampled, eng)
            if err is not None:
                p.future.set_exception(CaptureError(err))
                continue
            self.served += 1
            p.future.set_result(Captured(eng.result_of(taken, rid), p.sampled[0]))

    def _fail_all(self, e: BaseException) -> None:
        for p in self._pending.values():
            if not p.future.done():
                p.future.set_exception(e)
        self._pending.clear()
        while True:
            try:
                _, f = self._inbox.get_nowait()
            except queue.Empty:
                return
            if f.set_running_or_notify_cancel():
                f.set_exception(e)


def _self_check_problem(verdict: dict, i: int, rid: str, sampled: dict, eng) -> str | None:
    """The self-check's word on request ``i`` of a take, judged alone (None: it passed)."""
    one = {k: ([v[i]] if isinstance(v, list) else v) for k, v in verdict.items() if k != "seconds"}
    failed = judge([rid], one, sampled, eng._dtype_name, eng.self_check_stats)
    return f"self-check: {failed[0]}" if failed else None

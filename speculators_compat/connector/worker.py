"""The connector's worker side (each vLLM worker process): our capture on the model runner vLLM
built, driven by the scheduler side's step records instead of our own engine's calls.

Per step, before the forward (``bind``): new requests are announced to the capture (positions to
keep, the self-check's position), and the capturing rank creates each one's ``.lock`` with the
exclusive flock held, so the lock exists before vLLM can answer the request. The forward hooks copy
the step's rows into host memory (nothing grows on the device with the sequence). At the step's
end (``end_step``, from vLLM's ``get_finished``), the finished requests are judged (coverage, NaN/Inf,
the self-check: every rank of the tensor-parallel group takes part in it) and handed to a writer
thread, which renames the file in and then lets its lock go. A request that fails a check gets no file; its lock is removed
and the log names the request and the reason.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from ..engine import selfcheck, witness
from ..engine.capture import restart, trim
from ..engine.worker import CaptureExtension
from ..files import locks
from .records import CaptureStep, ConnectorSettings, FinishedCapture

logger = logging.getLogger("speculators_compat.connector")

WRITERS = 4  # writer threads of a capturing worker


class RunnerHost(CaptureExtension):
    """Our worker extension's capture calls over a model runner vLLM made (no extension mixed in)."""

    def __init__(self, runner):
        self.model_runner = runner
        self.vllm_config = getattr(runner, "vllm_config", None)


def find_runner():
    """The model runner whose ``initialize_kv_cache`` (or its KV-connector helper) is calling the
    connector's ``register_kv_caches``: the first caller up the stack that has a model and an
    ``execute_model``. vLLM hands a connector its KV caches but not the model."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if isinstance(getattr(obj, "model", None), torch.nn.Module) and callable(getattr(obj, "execute_model", None)):
            return obj
        frame = frame.f_back
    raise RuntimeError(
        "speculators_compat connector: no model runner found calling register_kv_caches; this vLLM "
        "version builds its KV connector where the capture cannot reach the model"
    )


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, layer_ids: list[int]):
        self.settings = settings
        self.layer_ids = layer_ids  # upstream's convention (what the capture takes)
        self.host: RunnerHost | None = None
        self.capturing = False  # this rank writes the files
        self.locks: dict[str, int] = {}  # req_id -> descriptor holding its .lock
        self.done: set[str] = set()  # written (or failed): their blocks may go
        self.finished_seen: set[str] = set()  # vLLM's finished ids, gathered over steps
        self.writer = None
        self.stats = selfcheck.SelfCheckStats()
        self.info: dict = {}

    def register(self, runner) -> None:
        self.host = RunnerHost(runner)
        fp8 = self.settings.states_dtype == "fp8"
        self.info = self.host.compat_capture_setup(self.layer_ids, handoff_prefix=None, fp8=fp8)
        self.capturing = getattr(self.host, "_compat_capture", None) is not None
        self.host.compat_self_check(self.settings.self_check)  # (off: the final layer's hook keeps nothing)
        if self.capturing:
            self.writer = ThreadPoolExecutor(WRITERS, thread_name_prefix="speculators-compat-hs")
            if self.settings.self_check:
                witness.watch_logits(self.host)
        logger.info("speculators_compat connector: capture installed (%s)", self.info)

    # -- before the forward --------------------------------------------------------------------
    def bind(self, step: CaptureStep) -> None:
        if self.host is None or not isinstance(step, CaptureStep):
            return
        for rid in step.restarted:
            restart(self.host, rid)
        if step.new:
            self.host.compat_capture_expect({c.req_id: c.capture_len for c in step.new})
            st = getattr(self.host, "_compat_capture", None)
            for c in step.new:
                if st is not None:
                    st.check_at[c.req_id] = c.prompt_len
                if self.capturing:
                    try:
                        self.locks[c.req_id] = locks.hold(c.path)
                    except OSError as e:  # (its file then fails to be written too, and says why)
                        logger.error("speculators_compat: request %s: cannot create %s.lock: %s", c.req_id, c.path, e)

    # -- at the end of the step ------------------------------------------------------------------
    def end_step(self, step: CaptureStep) -> None:
        if self.host is None or not isinstance(step, CaptureStep):
            return
        for d in step.dropped:
            self.host.compat_capture_take([d.req_id], want_data=False)
            locks.release(self.locks.pop(d.req_id, None), d.path, remove=True)
        if step.finished:
            self._finish(step.finished)

    def _finish(self, finished: list[FinishedCapture]) -> None:
        rids = [f.req_id for f in finished]
        verdict = None
        if self.settings.self_check:  # (a collective over the TP group: every rank, same requests)
            probe = [list(self._vllm_top(r)[0]) for r in rids]
            verdict = witness.check(self.host, rids, probe)
        if not self.capturing:
            witness.forget(self.host, rids)
            return
        try:
            self._hand_over(finished, verdict)
        except Exception:  # noqa: BLE001 - a fault of ours fails these requests (logged), not vLLM's engine
            logger.exception("speculators_compat: capture hand-over failed for requests %s", rids)
            for f in finished:
                if f.req_id not in self.done:
                    locks.release(self.locks.pop(f.req_id, None), f.path, remove=True)
                    self.done.add(f.req_id)

    def _hand_over(self, finished: list[FinishedCapture], verdict) -> None:
        """Capturing rank: each finished request judged, then written (or its lock removed)."""
        rids = [f.req_id for f in finished]
        for f in finished:
            trim(self.host, f.req_id, len(f.token_ids))
        sampled = {r: self._sampled(r) for r in rids}
        witness.forget(self.host, rids)
        taken = self.host.compat_capture_take(rids, want_data=True)
        dtype = str(self.host._compat_capture.dtype).replace("torch.", "")
        for i, f in enumerate(finished):
            problem = taken["errors"].get(f.req_id)
            if problem is None and verdict is not None:
                problem = _judge_one(i, f.req_id, verdict, sampled[f.req_id], dtype, self.stats)
            states = taken["states"].get(f.req_id)
            if problem is None and states is None:
                problem = "no rows were captured for it"
            lock = self.locks.pop(f.req_id, None)
            if problem is not None:
                logger.error("speculators_compat: request %s: %s; no hidden-states file written", f.req_id, problem)
                locks.release(lock, f.path, remove=True)
            else:
                self.writer.submit(_write, f, states, self.settings.states_dtype == "fp8", lock)
            self.done.add(f.req_id)

    def _vllm_top(self, rid: str) -> tuple[list, list]:
        w = getattr(self.host, "_compat_witness", None)
        return w.vllm_top.get(rid, ([], [])) if isinstance(w, witness.Witness) else ([], [])

    def _sampled(self, rid: str):
        ids, lps = self._vllm_top(rid)
        return (ids[0], ids, lps) if ids else None

    def finished_sending(self, finished_req_ids) -> set[str] | None:
        self.finished_seen.update(finished_req_ids or ())
        out = self.done & self.finished_seen
        self.done -= out
        self.finished_seen -= out
        return out or None

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.shutdown(wait=True)
        for rid, fd in list(self.locks.items()):
            locks.release(fd)
            self.locks.pop(rid, None)


def _judge_one(i, rid, verdict, sampled, dtype, stats) -> str | None:
    if sampled is None:
        return "self-check: vLLM's log-probabilities at its last prompt position were not seen"
    one = {k: ([v[i]] if isinstance(v, list) else v) for k, v in verdict.items() if k != "seconds"}
    fails = selfcheck.judge([rid], one, {rid: sampled}, dtype, stats)
    return fails[0] if fails else None


def _write(f: FinishedCapture, states: list, fp8: bool, lock: int | None) -> None:
    """Writer thread: the file renamed in, then its lock let go (also when the write fails: the lock
    is then removed with whatever was half written, and the log says why)."""
    from ..engine.fp8 import SCALES_KEY
    from ..files.formats import write_sample

    ok = False
    try:
        sample = {"input_ids": torch.tensor(f.token_ids, dtype=torch.long)}
        layers = states[:-1] if fp8 else states
        if fp8:
            sample[SCALES_KEY] = states[-1].reshape(-1)
        if any(layer.shape[0] != len(f.token_ids) for layer in layers):
            raise ValueError(f"{layers[0].shape[0]} rows captured for {len(f.token_ids)} token ids")
        check = sample[SCALES_KEY] if fp8 else torch.stack([x.float().sum(dim=-1) for x in layers])
        if not bool(torch.isfinite(check).all()):
            raise ValueError("NaN/Inf hidden states in a captured layer")
        sample["hidden_states"] = layers
        write_sample(f.path, sample, "speculators-hs")
        ok = True
    except Exception as e:  # noqa: BLE001 - a worker thread: logged with its request, the lock removed
        logger.error("speculators_compat: request %s: hidden-states file %s not written: %s", f.req_id, f.path, e)
    finally:
        locks.release(lock, f.path, remove=not ok)


# -- for tests and diagnostics, through vLLM's ``collective_rpc`` (every worker runs them) ---------
def _side():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = getattr(get_kv_transfer_group(), "worker", None)
    if not isinstance(side, WorkerSide):
        raise RuntimeError("speculators_compat: this worker's KV connector is not the CaptureConnector")
    return side


def capture_stats(worker=None) -> dict:
    """This worker's capture: what it installed and its self-check counts."""
    side = _side()
    return {"capturing": side.capturing, "info": side.info, "self_check": side.stats.as_dict()}


def inject_fault(worker=None, kind: str | None = None) -> None:
    """Tests only: make this worker's capture wrong on purpose (engine/faults.py)."""
    side = _side()
    if side.host is not None:
        side.host.compat_inject_fault(kind)

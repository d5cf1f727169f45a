"""The one engine loop: prompts in, per-request per-layer hidden states out, in input order.

Both the patched upstream generator and our drop-in generator run on this class, so a fix for a
new vLLM release lands here once.

Shape of the loop (every version 0.11 -> 0.32):
  1. ``EngineArgs(...).create_engine_config()`` builds the VllmConfig (vLLM's own public builder:
     it fills ``is_encoder_decoder``, block sizes, chunked-prefill budgets for each version) with
     prefix caching OFF (a cache hit skips computing, so nothing would be captured) and our worker
     extension;
  2. vLLM's in-process ``EngineCore`` builds the executor, profiles memory, sizes and initialises
     the KV cache, warms up, and creates the scheduler (with the right ``block_size`` /
     ``hash_block_size`` / block hasher for the version);
  3. per ``run()``: announce (request id, prompt length) to the workers, add one max_tokens=1
     ``Request`` per prompt, and step the EngineCore until every request finished. Its step drives
     the execute_model / sample_tokens two-phase protocol (0.12+) and the async batch queue; no
     request is ever aborted mid-prefill, so chunked prefill completes;
  4. take the captures (rank 0), keyed by request id, check coverage, return in input order.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from .. import envs
from ..errors import CaptureError, StallError, TokenIdError, WorkerDiedError
from ..host import cuda_device_count
from .config import EngineOptions, build_vllm_config, check_states_dtype, choose_start_method
from .fp8 import Fp8States, quantize_rows
from .handoff import ArenaReader, handoff_prefix, hold_handoff_lock
from .liveness import DEFAULT_TIMEOUT_S, PORT_OFFSET, DriverWatch
from .selfcheck import LOGPROBS, SelfCheckStats, first_logprobs, judge
from .stages import StageMap
from .stages import merge as merge_stages

#: how long a failed batch waits for a dead worker to show (vLLM's monitor, or the process's exit)
LOST_GRACE_S = 10.0  # how long a lost host's stop may take before the process ends (_on_host_lost)
WORKER_DEATH_WAIT_S = 2.0

logger = logging.getLogger("speculators_compat.engine")


def _params(fn) -> set:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def model_vocab_size(vllm_config) -> int | None:
    """The number of token ids the model's (text) embedding table has, as vLLM reads it."""
    mc = vllm_config.model_config
    get = getattr(mc, "get_vocab_size", None)
    v = get() if callable(get) else getattr(getattr(mc, "hf_text_config", None), "vocab_size", None)
    return int(v) if v else None


def check_token_ids(prompts: Sequence[Sequence[int]], vocab: int | None) -> None:
    """Raise TokenIdError for the first sequence holding an id the model cannot embed."""
    for i, p in enumerate(prompts):
        if not p:
            continue
        lo = min(p)
        if lo < 0:
            raise TokenIdError(i, lo, None)
        if vocab is not None:
            hi = max(p)
            if hi >= vocab:
                raise TokenIdError(i, hi, vocab)


class ExtractionEngine:
    """Owns one vLLM EngineCore with our capture extension."""

    def __init__(self, opts: EngineOptions, layer_ids: Sequence[int]):
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.abstract import Executor

        from . import facts as facts_mod

        self.opts = opts
        self.layer_ids = list(layer_ids)
        self.facts = facts_mod.probe()
        t0 = time.time()
        self.vllm_config = build_vllm_config(opts)
        method = choose_start_method(opts.worker_start_method, cuda_device_count(), os.environ)
        if method is not None:
            # config creation may have forced it (the CPU platform sets spawn); ours wins
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method
        lend = opts.zero_copy if opts.zero_copy is not None else envs.enabled("SPECULATORS_COMPAT_ZERO_COPY")
        self._reader = ArenaReader(lend=lend)
        executor_class = Executor.get_class(self.vllm_config)
        self._watch = self._lost = None
        pc = self.vllm_config.parallel_config
        if getattr(pc, "nnodes", 1) > 1:  # the other hosts' beats (liveness.py), before they connect
            self._watch = DriverWatch(
                opts.master_addr,
                pc.master_port + PORT_OFFSET,
                opts.liveness_timeout_s or DEFAULT_TIMEOUT_S,
                self._on_host_lost,
            )
        self._worker_failed = False
        self._interrupted = False
        self._closed = True  # (until the engine is up: a failure while it starts is vLLM's to report)
        self.core = EngineCore(
            self.vllm_config, executor_class, log_stats=False, executor_fail_callback=self._on_worker_failure
        )
        self._closed = False
        self._lock = threading.Lock()
        self._uid = uuid.uuid4().hex[:8]
        self._calls = 0
        self._handoff_prefix = handoff_prefix(self._uid)
        # held until shutdown: marks this engine's /dev/shm files as in use for other engines' sweeps
        self._handoff_lock = hold_handoff_lock(self._handoff_prefix) if self._handoff_prefix else None
        self.timings = {"drive_s": 0.0, "handoff_s": 0.0, "prep_s": 0.0, "busy_s": 0.0, "expect_s": 0.0, "check_s": 0.0}
        self._worker_slabs = None  # the worker's arena files as of its last take (None: not known)
        self.arena_slabs = 0  # batches of lent rows the caller holds at once (set_arena_slabs)
        # Does collective_rpc(unique_reply_rank=0) hand back the value (0.12+) or a 1-list (0.11)?
        # Probe the behaviour instead of trusting a version number.
        self._rpc_takes_rank = "unique_reply_rank" in _params(self.executor.collective_rpc)
        # Can a call be sent without waiting, its reply taken in order by the next call? (0.12+:
        # a queue of pending replies that every later call drains first; 0.11 needs a thread pool)
        self._can_announce_ahead = "non_block" in _params(self.executor.collective_rpc) and hasattr(
            getattr(self.executor, "futures_queue", None), "pop"
        )
        # Each batch is announced without waiting for the reply, which comes back in order after
        # its steps (less driver time per batch: docs/benchmarks.md); vLLM 0.11 waits.
        self._announce_ahead = self._can_announce_ahead
        probe = self._rpc_rank0_raw("compat_ping")
        self._rpc_unwrap = isinstance(probe, list)
        want = self._setup_capture(opts)
        self.self_check_stats = SelfCheckStats()
        self._self_check = True  # (what the workers start with)
        self.self_check = bool(want)
        self._dtype_name = str(self.vllm_config.model_config.dtype).replace("torch.", "")
        self.vocab_size = model_vocab_size(self.vllm_config)
        if self.vocab_size is None:
            logger.warning(
                "speculators_compat: cannot read the model's vocabulary size from vLLM's "
                "config; token ids will be checked for sign only"
            )
        self.startup_seconds = time.time() - t0
        logger.info(
            "engine ready in %.1fs (%s, layers %s)", self.startup_seconds, self.model_info.get("model"), self.layer_ids
        )

    def _setup_capture(self, opts: EngineOptions) -> bool:
        """Install the capture in every worker; learn which stage captures which layers and
        whether the self-check can run. Returns whether it was asked for."""
        self.states_dtype = check_states_dtype(opts.states_dtype)  # (checked with the config, before vLLM)
        # A token's FP8 scale spans every captured layer: one worker can compute it only when one
        # stage computes them all; across pipeline stages the driver quantizes (same arithmetic).
        pp = int(self.vllm_config.parallel_config.pipeline_parallel_size)
        self._quantize_here = self.states_dtype == "fp8" and pp > 1
        fp8_in_worker = self.states_dtype == "fp8" and not self._quantize_here
        infos = self.executor.collective_rpc(
            "compat_capture_setup", args=(self.layer_ids, self._handoff_prefix, fp8_in_worker)
        )
        self.model_info = infos[0]
        if not any(i.get("capturing") for i in infos):
            raise RuntimeError("speculators_compat: no worker rank captures hidden states")
        self.stages = StageMap.from_infos(infos, self.layer_ids)
        self.model_info["stages"] = self.stages.describe()
        # every request's sampled token against the logits of its captured state (selfcheck.py);
        # None: a stage before the last, which takes no part in it
        want = opts.self_check if opts.self_check is not None else envs.enabled("SPECULATORS_COMPAT_SELF_CHECK")
        why_not = next((i["self_check"] for i in infos if i.get("self_check") not in (True, None)), None)
        if want and why_not is not None:
            logger.warning("speculators_compat: the self-check cannot run with this model: %s", why_not)
        self._self_check_possible = why_not is None
        return bool(want)

    # ------------------------------------------------------------------ accessors
    @property
    def self_check(self) -> bool:
        """Is every request's sampled token checked against its captured state (selfcheck.py)?"""
        return self._self_check

    @self_check.setter
    def self_check(self, on: bool) -> None:
        on = bool(on) and self._self_check_possible
        if on != self._self_check:
            self.executor.collective_rpc("compat_self_check", args=(on,))
        self._self_check = on

    @property
    def executor(self):
        return self.core.model_executor

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def max_model_len(self) -> int:
        return int(self.vllm_config.model_config.max_model_len)

    def _rpc_rank0_raw(self, method: str, *args):
        if self._rpc_takes_rank:
            return self.executor.collective_rpc(method, args=args, unique_reply_rank=0)
        return self.executor.collective_rpc(method, args=args)

    def _rpc_rank0(self, method: str, *args):
        out = self._rpc_rank0_raw(method, *args)
        return out[0] if self._rpc_unwrap else out

    # ------------------------------------------------------------------ the loop
    def run(self, prompts: Sequence[Sequence[int]], *, ids_checked: bool = False) -> list[Any]:
        """Hidden states for each prompt: ``result[i][j]`` is [len(prompts[i]), hidden] for layer j;
        with FP8 states ``result[i]`` is an ``Fp8States`` (e4m3 layers and their scales).

        Token ids are checked against the vocabulary (TokenIdError) unless the caller already did
        (``ids_checked``: the drop-in generator checks them while validating the batch)."""
        if self._closed:
            raise RuntimeError("engine was shut down")
        with self._lock:
            return self._run(prompts, ids_checked)

    def _run(self, prompts, ids_checked=False):
        max_len = self.max_model_len - 1  # room for the one sampled token
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; at most max_model_len - 1 = {max_len} fit")
        if not ids_checked:
            check_token_ids(prompts, self.vocab_size)
        self._calls += 1
        t_prep = time.perf_counter()
        ids = [f"sc-{self._uid}-{self._calls}-{i}" for i in range(len(prompts))]
        busy = self._reader.busy(self._worker_slabs)
        self.timings["busy_s"] += time.perf_counter() - t_prep
        expect = ({r: len(p) for r, p in zip(ids, prompts)}, busy, self.arena_slabs if self.lends_rows else 0)
        ahead = None
        try:
            if self._announce_ahead:  # the reply comes back in order, before the first step's
                ahead = self.executor.collective_rpc("compat_capture_expect", args=expect, non_block=True)
            else:
                self.executor.collective_rpc("compat_capture_expect", args=expect)
            self.timings["expect_s"] += time.perf_counter() - t_prep
            check = self.self_check
            for rid, p in zip(ids, prompts):
                self.core.add_request(self._make_request(rid, list(p), check))
            t0 = time.perf_counter()
            self.timings["prep_s"] += t0 - t_prep
            sampled = self._drive()
            if ahead is not None:
                ahead.result()  # a worker that failed to take the batch (no room for it) raises here
            t1 = time.perf_counter()
            probe = [list(sampled[r][1]) if r in sampled and sampled[r][1] else [] for r in ids] if check else None
            taken = self.take_batch(ids, check, probe)
            self.timings["drive_s"] += t1 - t0
            self.timings["handoff_s"] += time.perf_counter() - t1
        except BaseException as e:
            interrupted = isinstance(e, KeyboardInterrupt)
            if interrupted:
                self._interrupted = True  # (workers the same signal ended are no news: see _on_worker_failure)
            if self._worker_died(wait_s=0.0 if interrupted else WORKER_DEATH_WAIT_S):
                self._closed = True
                self._cleanup_handoff()
                if interrupted:
                    raise  # Ctrl-C / SIGTERM sent to the whole process group took the workers down too
                raise WorkerDiedError(self._lost_message()) from e
            self._abandon(ids)
            raise
        errors = taken["errors"]
        if errors:
            detail = "; ".join(f"prompt {ids.index(r)}: {m}" for r, m in list(errors.items())[:5])
            raise CaptureError(f"{len(errors)} of {len(ids)} prompts were not fully captured: {detail}")
        if check:
            t_check = time.perf_counter()
            failed = judge(ids, taken["self_check"], sampled, self._dtype_name, self.self_check_stats)
            self.timings["check_s"] += time.perf_counter() - t_check
            if failed:
                raise CaptureError(
                    f"self-check: {len(failed)} of {len(ids)} prompts' states do not give the token vLLM "
                    "sampled for them: " + "; ".join(failed[:5])
                )
        return [self.result_of(taken, r) for r in ids]

    def take_batch(self, ids: list, check: bool, probe) -> dict:
        """The batch's rows from the capturing workers (each stage's under pipeline parallelism),
        errors and the self-check's verdict; ``states`` as tensors of their own or lent."""
        if self.stages.single:
            taken = self._rpc_rank0("compat_capture_take", ids, True, check, probe)
        else:
            replies = self.executor.collective_rpc("compat_capture_take", args=(ids, True, check, probe))
            taken = merge_stages(replies, self.layer_ids, ids)
        taken["states"] = self._copy_out(taken)
        return taken

    def result_of(self, taken: dict, rid: str):
        """A request's result: its layers, or ``Fp8States`` with FP8 states."""
        layers = taken["states"][rid]
        if taken.get("fp8"):  # the last entry of each is its per-token scales
            return Fp8States(layers[:-1], layers[-1])
        if self._quantize_here:
            q, scales = quantize_rows(layers)
            return Fp8States(q, scales[:, None])
        return layers

    def _copy_out(self, taken: dict) -> dict:
        """Per request, per layer tensors of their own (from the arena blocks, or as pickled)."""
        import torch

        states = taken["states"]
        if self._handoff_prefix is None:
            return states
        dtype = getattr(torch, taken["dtype"])
        shapes = [(taken["hidden"], dtype)] * len(self.layer_ids) + [(1, torch.float32)] if taken.get("fp8") else None
        # threads: handoff.auto_copy_threads (vLLM sets the driver's torch threads to 1: one core a task)
        out = self._reader.assemble_all(states, taken["hidden"], dtype, shapes)
        self._worker_slabs = taken.get("slabs")
        self._reader.forget_except(self._worker_slabs or ())
        return out

    def _drive(self) -> dict:
        """Step the engine until every request finished; for each request id, the token sampled
        and the log-probabilities vLLM reported with it (token ids, values: ``first_logprobs``)."""
        core = self.core
        step = core.step_fn
        sched = core.scheduler
        # Unfinished requests only: like vLLM's own busy loop, the workers learn which requests
        # finished with the next batch's first step, instead of through an extra empty step here.
        has_work = sched.has_unfinished_requests
        idle = 0
        sampled = {}
        while has_work() or (getattr(core, "batch_queue", None) or ()):
            outputs, executed = step()
            for batch in (outputs or {}).values():
                for o in batch.outputs:
                    if o.new_token_ids and o.request_id not in sampled:
                        sampled[o.request_id] = (o.new_token_ids[0], *first_logprobs(o.new_logprobs))
            idle = 0 if executed else idle + 1
            if idle > 200:
                raise StallError(
                    "the scheduler stopped scheduling with requests pending (200 steps without a "
                    "forward): a prompt may not fit the KV cache; lower the batch or raise memory"
                )
        return sampled

    def _cleanup_handoff(self) -> None:
        if self._handoff_prefix:
            import glob

            for f in glob.glob(self._handoff_prefix + "*"):  # the lock file too, while we hold it
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
        if getattr(self, "_handoff_lock", None) is not None:
            os.close(self._handoff_lock)
            self._handoff_lock = None

    def _on_host_lost(self, lost) -> None:  # called by the liveness watch's thread (liveness.py)
        """Another host is gone: stop the executor as vLLM's monitor does for a worker of this
        host, so that the call the main thread waits in fails (WorkerDiedError, naming the host).
        A call that still waits ``LOST_GRACE_S`` later (a reply vLLM waits for without a timeout)
        ends the process: the message, this engine's /dev/shm files removed, exit status 2."""
        if self._closed or self._lost is not None:
            return
        self._lost = lost
        logger.error("speculators_compat: lost %s; stopping the engine", lost)
        ex = getattr(getattr(self, "core", None), "model_executor", None)
        if ex is not None:
            ex.is_failed = True
            threading.Thread(target=ex.shutdown, name="speculators-compat-lost-host", daemon=True).start()
            callback, ex.failure_callback = getattr(ex, "failure_callback", None), None
            if callback is not None:
                callback()
        deadline = time.monotonic() + LOST_GRACE_S
        while not self._closed and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self._closed:
            from ..signals import end_process

            self._cleanup_handoff()
            print(f"speculators-compat: error: {self._lost_message()}", file=sys.stderr)
            end_process(2)

    def _lost_message(self) -> str:
        what = f"lost {self._lost}" if self._lost else "a vLLM worker process died"
        return (
            f"{what} during extraction; this engine is unusable. Outputs already written are complete; rerun to resume."
        )

    def _on_worker_failure(self) -> None:  # called by vLLM's worker monitor thread
        self._worker_failed = True
        # Ctrl-C or SIGTERM to the process group ends the workers too, and this thread can see it
        # before the main thread's KeyboardInterrupt: give that a moment to mark the run interrupted
        deadline = time.monotonic() + 1.0
        while not (self._interrupted or self._closed) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._interrupted and not self._closed and self._lost is None:
            logger.error("speculators_compat: a vLLM worker process died")

    def _worker_died(self, wait_s: float) -> bool:
        """Whether a worker process is gone: vLLM's monitor thread says so, or a worker's process
        has exited. The error a dead worker causes in the driver (its message queue "cancelled",
        a broken pipe) can come before the monitor's word, so this looks at the processes too,
        for up to ``wait_s`` (the monitor polls them)."""
        deadline = time.monotonic() + wait_s
        while True:
            procs = [getattr(w, "proc", None) for w in getattr(self.executor, "workers", None) or ()]
            if self._worker_failed or any(p is not None and p.exitcode is not None for p in procs):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _abandon(self, ids: list[str]) -> None:
        try:
            self.core.abort_requests(ids)
            self.executor.collective_rpc("compat_capture_take", args=(ids, False))
        except Exception as e:  # the engine may be dead already; report, don't mask the real error
            logger.warning("could not clean up requests after a failure: %s", e)

    def _make_request(self, rid: str, prompt: list[int], logprobs: bool = False):
        from vllm.sampling_params import SamplingParams

        from .requests import build_request

        # with the self-check, vLLM's own log-probabilities of its top tokens come back too (selfcheck.py)
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=LOGPROBS if logprobs else None)
        return build_request(rid, prompt, sp, block_hasher=self.core.request_block_hasher)

    # ------------------------------------------------------------------ lifecycle
    @property
    def lends_rows(self) -> bool:
        """Do results come back as lent arena rows (zero-copy through /dev/shm)?"""
        return self._reader.lend and self._handoff_prefix is not None

    def describe(self, t) -> tuple | None:
        """Where a returned tensor lives, if it is lent arena rows: (file, byte offset, rows)."""
        return self._reader.describe(t)

    def set_arena_slabs(self, n: int) -> None:
        """Say how many batches' results the caller will hold at once (a pipeline: its write
        queue plus the batch being computed); with lent rows, the worker makes that many arena
        slabs at the next batch instead of one at a time mid-run, whenever the caller falls
        further behind. 0 (default): made as needed."""
        n = int(n)
        if n < 0:
            raise ValueError(f"arena slabs must be >= 0, not {n}")
        self.arena_slabs = n

    def stats(self) -> dict:
        st = dict(self._rpc_rank0("compat_capture_stats"))
        st.update({k: round(v, 3) for k, v in self.timings.items()})
        return st

    def shutdown(self, _finalizing=sys.is_finalizing) -> None:
        # (``sys.is_finalizing`` bound at definition: at interpreter exit module globals may be None)
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if getattr(self, "_reader", None) is not None:
            self._reader.close()
        if getattr(self, "_watch", None) is not None:
            self._watch.close()  # (the hosts are told this is the end, not a loss)
        if getattr(self.vllm_config.parallel_config, "nnodes", 1) > 1 and not self._worker_failed:
            try:  # the other hosts' workers end themselves (the executor ends only this host's)
                self.executor.collective_rpc("compat_release_node", timeout=30)
            except Exception as e:
                logger.warning("could not release the other hosts' workers: %s", e)
        try:
            self.core.shutdown()
        except Exception as e:
            if not _finalizing():  # at interpreter exit vLLM's own loggers may be gone
                logger.warning("engine shutdown raised: %s", e)
        self._cleanup_handoff()  # the workers are gone: remove any arena file they left

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        self.shutdown()

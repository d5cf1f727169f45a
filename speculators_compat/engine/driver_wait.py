"""How the driver waits for its workers' replies (``SPECULATORS_COMPAT_DRIVER_WAIT``).

vLLM's driver reads each reply from a shared-memory ring buffer and, while the buffer is empty,
spins: a Python loop around ``sched_yield`` (0.11-0.17: for as long as it waits; 0.18+: for the
first second after each read, then it blocks on a zmq notification). The loop holds the GIL
between yields, so the driver's other threads (the pipeline's file writers, the copy threads)
may get it only in slices while the GPU works. ``block`` makes only the driver's reply queues
sleep ``SLEEP_S`` between checks instead of yielding, which frees the GIL; ``spin`` (default)
leaves vLLM as it is. Workers are not touched.

Measured (CPU, 2 cores, vLLM 0.32, benchmarks/throughput.py): ``block`` is slower there. Tiny
model, same run: generate() 115k vs 134k tok/s, pipeline 72k vs 76k. ~100M model:
generate()/raw 0.79 with ``block`` against 1.03 with ``spin`` (separate runs): the sleeping
driver's wake-ups preempt the worker's two compute threads. It exists for GPU hosts, where the
engine leaves cores free and the GIL is the contended resource; not yet measured there, so it is
opt-in.

Not vLLM's own idle mode (0.18+: block on the writer's zmq notification): driven on every
reply, it lost notifications (its PUB socket keeps one message and drops the rest) and calls
stalled for 5 s (seen on 0.32, CPU). A sleep needs nothing from the writer.

With ``block`` a reply is seen up to ~0.1 ms late; an engine step is milliseconds (CPU) to
~100 ms (GPU).
"""
from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("speculators_compat.engine")

DRIVER_WAIT_ENV = "SPECULATORS_COMPAT_DRIVER_WAIT"
DRIVER_WAIT_CHOICES = ("block", "spin")
SLEEP_S = 50e-6


def driver_wait_from_env() -> str:
    raw = os.environ.get(DRIVER_WAIT_ENV, "spin")
    if raw not in DRIVER_WAIT_CHOICES:
        raise ValueError(f"{DRIVER_WAIT_ENV} must be one of {DRIVER_WAIT_CHOICES}, not {raw!r}")
    return raw


class _SleepingSpin:
    """Stands in for vLLM's ``SpinTimer`` (0.11-0.17) on a driver reply queue: sleeps instead of
    yielding, so the GIL is free while the reply is not there."""

    def record_activity(self):
        pass

    def spin(self):
        time.sleep(SLEEP_S)


def _sleeping_wait(timeout_ms=None):
    """Stands in for ``SpinCondition.wait`` (0.18+) on a driver reply queue (set on the instance):
    the caller re-checks the buffer after it, as after vLLM's own wait."""
    time.sleep(SLEEP_S)


def reply_queues(executor) -> list:
    """The message queues the driver reads its workers' replies from."""
    mqs = getattr(executor, "response_mqs", None)  # 0.12+
    if mqs is None:  # 0.11: one per local worker
        mqs = [getattr(w, "worker_response_mq", None) for w in getattr(executor, "workers", None) or []]
    return [mq for mq in mqs if mq is not None]


def set_driver_wait(executor, mode: str, saved: dict) -> list[str]:
    """Make the driver's reply queues ``block`` or ``spin`` (vLLM's own). ``saved`` (one dict per
    engine) keeps what was replaced, so a switch back restores it. Returns how each queue waits now; a queue this
    module does not recognise is left spinning, and that is logged (speed only, not results)."""
    if mode not in DRIVER_WAIT_CHOICES:
        raise ValueError(f"driver wait must be one of {DRIVER_WAIT_CHOICES}, not {mode!r}")
    if mode == "spin" and not saved:  # nothing was replaced: vLLM's own wait, untouched
        return ["spin"] * len(reply_queues(executor))
    how = []
    for mq in reply_queues(executor):
        key = id(mq)
        cond = getattr(mq, "_spin_condition", None)
        if cond is not None and getattr(cond, "is_reader", False) and callable(getattr(cond, "wait", None)):  # 0.18+
            saved.setdefault(key, None)  # (the original is the class's method)
            if mode == "block":
                cond.wait = _sleeping_wait
            else:
                cond.__dict__.pop("wait", None)  # the class's own method again
            how.append(f"block (sleep {SLEEP_S * 1e6:.0f} us)" if mode == "block" else "spin")
        elif hasattr(mq, "_read_spin_timer"):  # 0.11-0.17
            saved.setdefault(key, mq._read_spin_timer)
            mq._read_spin_timer = _SleepingSpin() if mode == "block" else saved[key]
            how.append(f"{mode} (sleep {SLEEP_S * 1e6:.0f} us)" if mode == "block" else "spin")
        else:
            logger.warning("speculators_compat: driver wait %r not applied to %s (no _spin_condition or "
                           "_read_spin_timer on this vLLM's MessageQueue); it keeps vLLM's own wait",
                           mode, type(mq).__name__)
            how.append("unrecognised (vLLM's own)")
    if not how:
        logger.warning("speculators_compat: driver wait %r: no reply queue found on %s; vLLM's own wait stays",
                       mode, type(executor).__name__)
    return how

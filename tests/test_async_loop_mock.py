"""The async-scheduling branch of our engine loop, which only a GPU reaches.

On CPU vLLM forces ``async_scheduling=False`` (platforms/cpu.py), so EngineCore never has a batch
queue there and the real-engine tests cannot reach this branch. This test stands in a fake
EngineCore (pytest-mock) with vLLM's batch-queue semantics: a request is finished only when the
step that *returns* its batch runs, which can be after the scheduler has nothing left to schedule.
What it checks is our loop: it keeps stepping while batches are in flight, and it stops (with a
clear error) when nothing progresses. The real thing runs on the H200 (docs/results/h200-*-correctness-*.json).
"""

from collections import deque

import pytest

from speculators_compat.engine.config import resolve_async
from speculators_compat.engine.core import ExtractionEngine
from speculators_compat.errors import StallError


class FakeAsyncCore:
    """EngineCore with a 2-deep batch queue: schedule now, results one step later."""

    def __init__(self, n_requests):
        self.pending = n_requests
        self.batch_queue = deque(maxlen=2)
        self.finished = 0
        self.calls = 0
        self.scheduler = self

    def has_unfinished_requests(self):
        return self.pending > 0

    def step_fn(self):
        self.calls += 1
        if self.pending and len(self.batch_queue) < 2:
            take = min(2, self.pending)
            self.pending -= take
            self.batch_queue.appendleft(take)
            return None, True
        if self.batch_queue:
            self.finished += self.batch_queue.pop()
            return {}, False
        return None, False


def _engine_with(core):
    eng = ExtractionEngine.__new__(ExtractionEngine)
    eng.core = core
    return eng


def test_loop_drains_in_flight_batches():
    core = FakeAsyncCore(5)
    _engine_with(core)._drive()
    assert core.finished == 5, "stopped with batches still in flight: their captures would be lost"
    assert not core.batch_queue


def test_loop_reports_a_stall(mocker):
    core = mocker.Mock()
    core.batch_queue = None
    core.scheduler.has_unfinished_requests.return_value = True  # a request that never gets scheduled
    core.step_fn.return_value = (None, False)
    with pytest.raises(StallError, match="KV cache"):
        _engine_with(core)._drive()


def test_async_strategy_choice():
    assert resolve_async(None) == "keep"  # vLLM's own choice (async scheduling where it has it)
    assert resolve_async("disable") == "disable" and resolve_async("keep") == "keep"
    with pytest.raises(ValueError, match="async_scheduling must be one of"):
        resolve_async("sometimes")

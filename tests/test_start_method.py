"""How the engine has vLLM start its workers (speculators_compat.engine.core.choose_start_method).

The CUDA branch cannot run on the CPU machines: on the H200 (vLLM 0.20) forked workers died at
start-up after the driver had queried CUDA (speculators 0.3.0's class + the import, Kimi-K2.5), and
spawned ones started (docs/kimi-k25.md). These cases pin the rule itself."""

import pytest

from speculators_compat.engine.config import choose_start_method


def test_spawn_on_a_cuda_host_by_default():
    assert choose_start_method(None, 1, {}) == "spawn"
    assert choose_start_method(None, 8, {"VLLM_WORKER_MULTIPROC_METHOD": ""}) == "spawn"


def test_the_users_choice_wins():
    assert choose_start_method("fork", 8, {}) == "fork"
    assert choose_start_method(None, 8, {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}) is None  # left to vLLM (fork)


def test_cpu_hosts_keep_vllms_choice():
    assert choose_start_method(None, 0, {}) is None
    assert choose_start_method("spawn", 0, {}) == "spawn"


def test_a_bad_method_is_named():
    with pytest.raises(ValueError, match="worker_start_method must be 'fork' or 'spawn', not 'forkserver'"):
        choose_start_method("forkserver", 1, {})

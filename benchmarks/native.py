"""vLLM's own hidden-state extractor, as the benchmark and the probe run it.

``engine_kwargs`` gives the ``LLM(...)`` arguments that turn on the ``extract_hidden_states``
method with ``ExampleHiddenStatesConnector`` (one safetensors file a prompt, ``hidden_states``
[tokens, layers, hidden]). On a CPU, where the connectors that write on a thread pool copy the rows
on a CUDA stream first, it names the CPU stand-in of ``native_cpu_connector.py`` and puts this
directory on the workers' ``PYTHONPATH``. ``file_complete`` / ``wait_complete`` say when a file is
whole: those connectors hold ``FILE.lock`` until it is; the older ones write inside the engine step
and make no lock.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def engine_kwargs(store: str, layer_ids: list[int], cuda: bool) -> dict:
    """``layer_ids`` in vLLM's convention (id i = output of i decoder layers), each once, ascending."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock

    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": store},
    }
    if not cuda and hasattr(stock.ExampleHiddenStatesConnector, "_submit_async_write"):
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
        kv.update(kv_connector="CpuHiddenStatesConnector", kv_connector_module_path="native_cpu_connector")
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": kv,
    }


def file_complete(path: str) -> bool:
    """Whether the connector has finished ``path`` (exists, and no writer holds its lock)."""
    import fcntl

    if not os.path.exists(path):
        return False
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def wait_complete(path: str, timeout: float = 600.0) -> None:
    """Block until ``path`` is whole (sleeping on its lock where there is one)."""
    import fcntl

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"native: {path} was never written")
        time.sleep(0.001)
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # sleeps until the writer releases it
    finally:
        os.close(fd)

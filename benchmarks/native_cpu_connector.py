"""A CPU stand-in for vLLM's ``ExampleHiddenStatesConnector``, for ``throughput.py --native`` only.

From vLLM 0.2x the stock connector copies a finished request's rows out of the hidden-state cache
on a CUDA side stream into page-locked memory and records a CUDA event that its writer thread and
``get_finished`` wait on. vLLM's CPU build has no CUDA, so this subclass gathers the rows with a
plain CPU index and hands the writer an event that is already complete; everything else (which
requests are saved, file names, lock files, the writer pool, when blocks are freed) is the stock
connector's. It is not part of the library: the benchmark puts this directory on the workers'
``PYTHONPATH`` and names this module in ``kv_connector_module_path``.
"""

from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)


class _Done:
    """What the stock writer expects of a CUDA event, for a copy that already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:  # the stock method's CUDA copy, done on the CPU
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache  # [blocks, heads, block_size, head_size]
        bs = cache.shape[2]
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        n = pending.token_ids.shape[0]
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        rows = cache[slots // bs, :, slots % bs].clone()
        tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))

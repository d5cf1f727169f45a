"""vLLM's own hidden-state extractor, as the benchmark and the probe run it.

``engine_kwargs`` gives the ``LLM(...)`` arguments that turn on the ``extract_hidden_states``
method with ``ExampleHiddenStatesConnector`` (one safetensors file a prompt, ``hidden_states``
[tokens, layers, hidden]). On a CPU, where the connectors that write on a thread pool copy the rows
on a CUDA stream first, it names the CPU stand-in of ``native_cpu_connector.py`` and puts this
directory on the workers' ``PYTHONPATH``. ``file_complete`` / ``wait_complete`` say when a file is
whole: those connectors hold ``FILE.lock`` until it is; the older ones write inside the engine step
and make no lock. ``Contender``: the whole extractor as ``throughput.py`` times it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

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


class Contender:
    """vLLM's own extractor as ``throughput.py`` times it: a ``Bench``'s batches through
    ``LLM.generate(max_tokens=1)``, a run over when its last file is whole; each file's header
    checked for its prompt's shape, untimed, and the files then deleted."""

    def __init__(self, bench):
        from vllm import LLM, SamplingParams

        self.b = b = bench
        self.store = tempfile.mkdtemp(prefix="native-", dir=b.out_roots[b.out_dirs[0]])
        # vLLM's convention (output of i layers: ours + 1), each layer once, ascending, as vLLM keeps them
        self.ids = sorted({i + 1 for i in b.layer_ids_resolved})
        args = engine_kwargs(self.store, self.ids, b.cuda)
        self.llm = LLM(**b.llm_args, **args)
        kv = args["kv_transfer_config"]
        b.native_info.update(layer_ids=self.ids, connector=kv["kv_connector"], complete_at_return=[])
        self.sp = SamplingParams(max_tokens=1, temperature=0.0)
        reqs = [[{"prompt_token_ids": p} for p in batch] for batch in b.batches]
        self.written: list[tuple[str, int]] = []
        self.calls = b.per_batch("native", [lambda r=r: self._call(r) for r in reqs])

    def _call(self, r):
        outs = self.llm.generate(r, self.sp, use_tqdm=False)
        files = [(o.kv_transfer_params["hidden_states_path"], len(o.prompt_token_ids)) for o in outs]
        done = sum(file_complete(f) for f, _ in files) / len(files)
        self.b.native_info["complete_at_return"].append(done)
        self.written.extend(files)

    def run(self, record=True):
        self.written.clear()
        self.calls(record)
        for f, _ in self.written:  # the run ends when its last file is whole
            wait_complete(f)

    def warm(self, keep_first=True):  # untimed; the first batch's states kept for compare_native
        self.run(record=False)
        if keep_first:
            self.b.native_info["first_batch"] = self.first_batch_states()
        self.check_and_clean()

    def timed_run(self):  # one timed run: time, then check + delete untimed
        t = time.perf_counter()
        self.run()
        self.b.rec("native", time.perf_counter() - t)
        self.check_and_clean()

    def check_and_clean(self):  # every file's header has its prompt's shape; then delete
        from speculators_compat.checkpoint import read_safetensors_header

        b = self.b
        want_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[b.a.dtype]
        for f, n in self.written:
            hs = json.loads(read_safetensors_header(Path(f))[0])["hidden_states"]
            if hs["shape"] != [n, len(self.ids), b.hidden] or hs["dtype"] != want_dtype:
                raise RuntimeError(f"native: {f} holds {hs}, expected [{n}, {len(self.ids)}, {b.hidden}]")
        b.native_info["files_checked"] = b.native_info.get("files_checked", 0) + len(self.written)
        shutil.rmtree(self.store, ignore_errors=True)
        os.makedirs(self.store, exist_ok=True)

    def first_batch_states(self):
        from safetensors.torch import load_file

        return [load_file(f)["hidden_states"] for f, _ in self.written[: len(self.b.batches[0])]]

    def close(self):
        shut(self.llm)
        del self.llm


def shut(llm) -> None:
    """End an ``LLM``'s engine processes now (not at garbage collection)."""
    if hasattr(llm.llm_engine, "engine_core"):
        llm.llm_engine.engine_core.shutdown()

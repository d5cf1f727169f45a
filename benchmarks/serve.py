#!/usr/bin/env python3
"""``speculators-compat serve`` against ``vllm serve`` with its own extractor, measured in one run.

Contenders (same model, dtype, max_model_len, max_num_batched_tokens, eager mode, prefix caching
off, the same prompts), each a server in its own process, driven by the same client: asyncio, one
``completions.create(prompt=<token ids>, max_tokens=1, return_token_ids)`` per prompt, at most
``C`` in flight, each request timed from its send until its file is complete (the connector's lock
released), the file then deleted (as speculators' online trainer does):
  serve     speculators-compat serve
  native    vllm serve with --speculative-config method extract_hidden_states and
            ExampleHiddenStatesConnector (on a CPU its CPU stand-in: native_cpu_connector.py)
  generate  in-process VllmHiddenStatesGenerator.generate() over the same prompts in batches of C:
            what the server adds to the engine
Per contender and concurrency: requests/s, prompt tokens/s, p50 / p99 latency, each line printed as
soon as it is measured. One server at a time; on a CPU every engine gets the same thread binding and
reserved cores.
    python benchmarks/serve.py --model llama --prompts 64 --seq-mixed 64,512 --concurrency 1,8,32

``--long 32768,120000`` (a GPU): one prompt of each length through ``serve`` and through plain
``vllm serve`` (no connector, the same settings), the model's ``max_position_embeddings`` raised to
fit; the device's peak memory in use during each request (nvidia-smi, every 20 ms) above what it
held idle, and the ratio serve / plain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: str, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)  # noqa: SIM115
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited at start; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{cmd[:4]} did not come up; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def engine_flags(a, max_len: int) -> list[str]:
    """The engine settings every contender gets."""
    return [
        "--dtype",
        a.dtype,
        "--max-model-len",
        str(max_len),
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
    ]


async def load(url: str, model: str, prompts: list[list[int]], c: int) -> dict:
    import openai

    sys.path.insert(0, HERE)
    import native

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(c)
    lat: list[float] = []

    async def one(ids):
        async with sem:
            t = time.perf_counter()
            r = await client.completions.create(
                model=model, prompt=ids, max_tokens=1, extra_body={"return_token_ids": True}
            )
            params = getattr(r, "kv_transfer_params", None)  # (none from a server without a connector)
            path = params["hidden_states_path"] if params else None
            if path:
                await asyncio.to_thread(native.wait_complete, path)
            lat.append(time.perf_counter() - t)
            for p in (path, f"{path}.lock") if path else ():
                if os.path.exists(p):
                    os.unlink(p)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()
    dt = time.perf_counter() - t0
    lat.sort()
    return {
        "requests_per_s": round(len(prompts) / dt, 2),
        "tokens_per_s": round(sum(map(len, prompts)) / dt, 1),
        "p50_s": round(statistics.median(lat), 3),
        "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="tiny model name (llama, llama-100m, llama-1b) or a path")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--seq-mixed", default="64,512")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--layers", default=None, help="vLLM's layer ids (default: speculators >= 0.5's)")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--long", default=None, help="prompt lengths for the device-memory case (see above)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.long:
        return long_prompts(a)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # equal thread binding and reserved cores for every engine (throughput.py says why)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from speculators_compat.layers import read_num_layers
    from speculators_compat.layers import resolve as resolve_layers
    from speculators_compat.testing import models

    path = a.model if os.path.isdir(a.model) else str(models.build(a.model))
    upstream = resolve_layers(
        [int(x) for x in a.layers.split(",")] if a.layers else None, read_num_layers(path), None, "speculators-hs"
    )
    vllm_ids = [i + 1 for i in upstream]
    lo, hi = (int(x) for x in a.seq_mixed.split(","))
    rng = random.Random(7)
    prompts = models.random_prompts([rng.randint(lo, hi) for _ in range(a.prompts)], seed=7)
    cs = [int(x) for x in a.concurrency.split(",")]
    max_len = max(2048, hi + 8)
    tmp = tempfile.mkdtemp(prefix="sc-serve-bench-")
    rows: dict[str, dict] = {}
    common = engine_flags(a, max_len)
    if a.gpu_memory_utilization:
        common += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    print(
        json.dumps({"model": a.model, "prompts": a.prompts, "seq": a.seq_mixed, "dtype": a.dtype, "layers": vllm_ids})
    )

    port = free_port()
    cmd = [sys.executable, "-m", "speculators_compat.cli", "serve", "--model", path, "--port", str(port)]
    cmd += ["--hidden-states-path", os.path.join(tmp, "ours"), *common]
    cmd += ["--layer-ids", ",".join(map(str, vllm_ids))] if a.layers else []  # (else: the same default)
    cmd += ["--served-model-name", "m"]
    rows.update(_run_server("serve", cmd, port, prompts, cs, os.path.join(tmp, "serve.log")))
    if not a.no_native:
        sys.path.insert(0, HERE)
        import native

        store = os.path.join(tmp, "native")
        kw = native.engine_kwargs(store, vllm_ids, cuda=_cuda())
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port)]
        cmd += ["--served-model-name", "m", "--enforce-eager", "--no-enable-prefix-caching", *common]
        cmd += ["--speculative-config", json.dumps(kw["speculative_config"])]
        cmd += ["--kv-transfer-config", json.dumps(kw["kv_transfer_config"])]
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        rows.update(_run_server("native", cmd, port, prompts, cs, os.path.join(tmp, "native.log"), env))
    if not a.no_generate:
        rows.update(_run_generate(path, upstream, prompts, cs, a, max_len))
    print("| contender | concurrency | requests/s | tokens/s | p50 s | p99 s |")
    print("|---|---|---|---|---|---|")
    for k, r in rows.items():
        name, c = k.rsplit("@", 1)
        print(
            f"| {name} | {c} | {r.get('requests_per_s', '')} | {r['tokens_per_s']:,} | {r.get('p50_s', '')} | {r.get('p99_s', '')} |"
        )
    for c in cs:
        if f"native@{c}" in rows:
            print(
                f"serve / native at {c}: {rows[f'serve@{c}']['tokens_per_s'] / rows[f'native@{c}']['tokens_per_s']:.3f}"
            )
        if f"generate@{c}" in rows:
            print(
                f"serve / generate at {c}: {rows[f'serve@{c}']['tokens_per_s'] / rows[f'generate@{c}']['tokens_per_s']:.3f}"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "args": {k: v for k, v in vars(a).items() if k != "json"}}, f, indent=1)
    return 0


def _run_server(name, cmd, port, prompts, cs, log, env=None) -> dict:
    proc = start(cmd, port, log, env)
    out = {}
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(load(url, "m", prompts[: max(cs)], max(cs)))  # warm-up
        for c in cs:
            out[f"{name}@{c}"] = asyncio.run(load(url, "m", prompts, c))
            print(f"MEASURED {name}@{c} {json.dumps(out[f'{name}@{c}'])}", flush=True)
    finally:
        stop(proc)
    return out


def _run_generate(path, layer_ids, prompts, cs, a, max_len) -> dict:
    from speculators_compat import VllmHiddenStatesGenerator

    out = {}
    gen = VllmHiddenStatesGenerator(
        path, layer_ids=layer_ids, dtype=a.dtype, max_model_len=max_len, max_num_batched_tokens=a.max_num_batched_tokens
    )
    try:
        gen.generate(prompts[: max(cs)])
        for c in cs:
            t = time.perf_counter()
            for i in range(0, len(prompts), c):
                gen.generate(prompts[i : i + c])
            out[f"generate@{c}"] = {"tokens_per_s": round(sum(map(len, prompts)) / (time.perf_counter() - t), 1)}
            print(f"MEASURED generate@{c} {json.dumps(out[f'generate@{c}'])}", flush=True)
    finally:
        gen.close()
    return out


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _device_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return int(out.stdout.split()[0])


def _peak_during(fn) -> tuple[int, float]:
    """(peak device MiB in use while ``fn()`` runs, its seconds), nvidia-smi every 20 ms."""
    import threading

    peak, done = [0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], _device_used_mib())
            time.sleep(0.02)

    t = threading.Thread(target=poll)
    t.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return peak[0], time.perf_counter() - t0


def long_prompts(a) -> int:
    """One prompt of each --long length through serve and plain vllm serve: peak device memory."""
    import shutil

    from speculators_compat.testing import models

    lengths = [int(x) for x in a.long.split(",")]
    src = a.model if os.path.isdir(a.model) else str(models.build(a.model))
    path = tempfile.mkdtemp(prefix="sc-long-model-")
    shutil.copytree(src, path, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(path, "config.json")))
    max_len = max(lengths) + 16
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    prompts = models.random_prompts(lengths, seed=3, vocab=cfg["vocab_size"])
    tmp = tempfile.mkdtemp(prefix="sc-long-")
    common = engine_flags(a, max_len)
    common += ["--gpu-memory-utilization", str(a.gpu_memory_utilization or 0.5), "--served-model-name", "m"]
    port = free_port()
    ours = [sys.executable, "-m", "speculators_compat.cli", "serve", "--model", path, "--port", str(port)]
    ours += ["--hidden-states-path", os.path.join(tmp, "hs"), *common]
    plain = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port)]
    plain += ["--enforce-eager", "--no-enable-prefix-caching", *common]
    rows = {}
    for name, cmd in (("plain", plain), ("serve", ours)):
        proc = start(cmd, port, os.path.join(tmp, f"{name}.log"))
        try:
            idle = _device_used_mib()
            for ids in prompts:
                peak, secs = _peak_during(lambda ids=ids: asyncio.run(load(f"http://127.0.0.1:{port}", "m", [ids], 1)))
                rows[f"{name}@{len(ids)}"] = {
                    "idle_mib": idle,
                    "peak_mib": peak,
                    "above_idle_mib": peak - idle,
                    "s": round(secs, 2),
                }
                print(f"MEASURED {name}@{len(ids)} {json.dumps(rows[f'{name}@{len(ids)}'])}", flush=True)
        finally:
            stop(proc)
    for n in lengths:
        s_, p_ = rows[f"serve@{n}"], rows[f"plain@{n}"]
        print(f"peak device memory serve / plain at {n} tokens: {s_['peak_mib'] / p_['peak_mib']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"long": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

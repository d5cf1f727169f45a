#!/usr/bin/env python3
"""Throughput on one engine configuration and one batch, measured in one run.

Contenders (same model, dtype, max_model_len, max_num_batched_tokens, eager mode, prefix caching off),
each fed the same ``--batches`` batches of ``--batch`` prompts of ``--seq`` tokens, one engine call per
batch:
  raw       vLLM's own LLM.generate(max_tokens=1) per batch (prefill + one sampled token)
  generate  speculators_compat VllmHiddenStatesGenerator.generate() per batch (capture + hand-off)
  pipeline  the full extract pipeline over the same batches (--batch-size = --batch): generate +
            every sample's file written by the pipeline's writers, manifest at the end; timed around
            run_extract (deleting the output afterwards is not timed)
  native    vLLM's own extractor (vLLM >= 0.18): LLM.generate(max_tokens=1) with
            speculative_config method "extract_hidden_states" and ExampleHiddenStatesConnector, which
            writes one safetensors file a prompt ([tokens, layers, hidden]); timed until every file
            of the run is complete (its lock released, where the connector makes one), each file's
            header then checked for the prompt's shape; how many were complete when each
            generate() returned is recorded. Same layers as ours (vLLM's ids: ours + 1). On CPU the
            stock connector's CUDA copy is replaced by a CPU gather (native_cpu_connector.py). Its
            first batch's states are compared with ours (bit-identical is the expectation).
  hf        HF transformers forward with output_hidden_states, micro-batched
With ``--states-dtypes auto,fp8`` the generate and pipeline contenders run once more on an engine with
``states_dtype="fp8"`` (rows ``generate[..][fp8]``, ``pipeline[fp8]...``: quantized in the workers),
and the first batch's FP8 error is reported per layer and token (relative L2 over the hidden size,
worst and median), against the unquantized engine's states and against HF (float32), beside the
unquantized states' own error against HF; each pipeline row notes its bytes per token.
Each is warmed up once, then the contenders run in turn, ``--reps`` rounds (alternating, so drift hits
all); the table gives the median tokens/s and the spread (min-max), and the last line the ratios.
Per-batch times of raw, generate and native are kept too: ``first_batch`` gives, per timed run, the
first batch's tokens/s over the median of that run's other batches (the first run's first batch is
the first call after warm-up).

On CPU, hold thread binding and reserved cores equal across engines (unequal settings once gave a 2x
artefact otherwise): this script sets VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU once
for both engines. On CPU the two engines run one after the other (``--sequential``: an idle vLLM CPU
engine's workers still poll), in the order raw, ours, raw, ours...
    python benchmarks/throughput.py --model llama --batch 64 --seq 128
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _hidden_size(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)["hidden_size"]


def _sample_bytes(path: str, lengths: list[int], itemsize: int, layers: str | None) -> int:
    """Bytes of hidden states in one median-length sample (what a data file mostly holds)."""
    n_layers = len(layers.split(",")) if layers else 4  # upstream's default ids: 4 of them
    return int(statistics.median(lengths)) * _hidden_size(path) * n_layers * itemsize


def _file_cost_us(root: str, nbytes: int, n: int | None = None) -> dict:
    """CPU microseconds (this thread: user + kernel) per file to create, write ``nbytes`` and rename
    into ``root``, as the pipeline's writer does (the files are deleted afterwards, untimed)."""
    from speculators_compat.files.formats import write_parts

    n = n or max(20, min(400, (256 << 20) // max(nbytes, 1)))  # at most ~256 MiB written
    d = tempfile.mkdtemp(prefix="fs-probe-", dir=root)
    data = os.urandom(nbytes)
    t = time.thread_time()
    for i in range(n):
        write_parts(os.path.join(d, f"data_{i}.pt"), [data])
    per_file = (time.thread_time() - t) / n * 1e6
    shutil.rmtree(d)
    return {"write_us": round(per_file, 1), "files": n}


def _plain_write_s(root: str, sizes: list[int]) -> float:
    """Seconds for one thread to write files of ``sizes`` bytes into ``root`` (writer.py's plain
    write: one write and fdatasync a file), the baseline the pipeline's disk rate is held against;
    the files are deleted afterwards, untimed."""
    import writer

    d = Path(tempfile.mkdtemp(prefix="plain-", dir=root))
    data = memoryview(os.urandom(max(sizes)))
    dt = writer.write_plain(d, ((f"data_{i}.bin", [data[:n]]) for i, n in enumerate(sizes)))
    shutil.rmtree(d)
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="tiny model name (llama, llama-100m, llama-1b) or a path")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--batches", type=int, default=4, help="batches per timed run (the pipeline's writes overlap the next)"
    )
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--seq-mixed",
        default=None,
        help="LO,HI: each prompt's length drawn (seeded) from LO..HI "
        "instead of --seq, so engine steps split prompts as with a real dataset",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--layers", default=None, help="comma-separated layer ids (default: upstream's 4)")
    ap.add_argument(
        "--writer-threads", default=None, help="e.g. '8,16': pipeline writer threads (default: the pipeline's)"
    )
    ap.add_argument("--writer-modes", default="auto", help="e.g. 'thread,process': the pipeline's writer")
    ap.add_argument(
        "--pt-writers",
        default=None,
        help="e.g. 'direct,torch': how data_{i}.pt files are made "
        "(SPECULATORS_COMPAT_PT_WRITER: the direct encoder, the default, or torch.save)",
    )
    ap.add_argument(
        "--checksums",
        default="crc32",
        help="e.g. 'crc32,sha256': the pipeline's file checksum (crc32 is the pipeline's default)",
    )
    ap.add_argument("--formats", default="pt", help="e.g. 'pt,safetensors': the pipeline's output format")
    ap.add_argument(
        "--shard-sizes",
        default="1",
        help="e.g. '1,64': samples per file (> 1: safetensors shards, timed with --formats safetensors only)",
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where the pipeline writes (default: a temp dir; e.g. /dev/shm to take the disk out of the measurement)",
    )
    ap.add_argument(
        "--out-dirs",
        default=None,
        help="e.g. '/tmp,/dev/shm': time the pipeline writing to each, "
        "alternated in one run (overrides --out-dir for the pipeline's output)",
    )
    ap.add_argument(
        "--states-dtypes",
        default="auto",
        help="e.g. 'auto,fp8': the generate and pipeline contenders on an engine of each states dtype "
        "(on a GPU all engines stay alive: leave room for each with --gpu-memory-utilization)",
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-native", action="store_true", help="leave out vLLM's own extractor")
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args(argv)
    if a.seq_mixed and not a.no_hf:
        ap.error("--seq-mixed needs --no-hf (the HF contender runs equal-length micro-batches)")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from packaging.version import Version

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import native

    import speculators_compat  # noqa: F401
    from speculators_compat import VllmHiddenStatesGenerator, versions
    from speculators_compat.pipeline.extract import run_extract
    from speculators_compat.testing import models

    cuda = torch.cuda.is_available()
    if cuda:  # the check above may initialise CUDA here: vLLM's processes must then be spawned
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    path = a.model if os.path.isdir(a.model) else str(models.build(a.model))
    if a.seq_mixed:
        import random

        lo, hi = (int(x) for x in a.seq_mixed.split(","))
        rng = random.Random(7)
        lengths = [rng.randint(lo, hi) for _ in range(a.batch * a.batches)]
    else:
        lengths = [a.seq] * (a.batch * a.batches)
    prompts = models.random_prompts(lengths, seed=7)
    batches = [prompts[i : i + a.batch] for i in range(0, len(prompts), a.batch)]
    tokens = sum(lengths)
    common = dict(
        max_model_len=max(2048, max(lengths) + 8),
        dtype=a.dtype,
        max_num_batched_tokens=a.max_num_batched_tokens,
        gpu_memory_utilization=a.gpu_memory_utilization,
    )
    times: dict[str, list[float]] = {}
    batch_s: dict[str, list[list[float]]] = {}  # per timed run: each engine call's seconds

    def per_batch(name, calls):  # -> run(record): the calls in turn, each one's seconds noted
        def run(record=True):
            ts = []
            for c in calls:
                t = time.perf_counter()
                c()
                ts.append(time.perf_counter() - t)
            if record:
                batch_s.setdefault(name, []).append(ts)

        return run

    from speculators_compat.checkpoint import read_safetensors_header
    from speculators_compat.layers import default_layer_ids, read_num_layers

    layer_ids = [int(x) for x in a.layers.split(",")] if a.layers else None
    layer_ids_resolved = layer_ids or default_layer_ids(read_num_layers(path))
    hidden = _hidden_size(path)
    dev = "cuda" if cuda else "cpu"
    with_native = not a.no_native and Version(versions.installed("vllm")).release >= (0, 18)
    tmp = tempfile.mkdtemp(prefix="sc-bench-", dir=a.out_dir)
    out_dirs = a.out_dirs.split(",") if a.out_dirs else [None]  # None: under tmp
    out_roots = {d: (tempfile.mkdtemp(prefix="sc-bench-", dir=d) if d else tmp) for d in out_dirs}
    default_dir = a.out_dir or tempfile.gettempdir()  # (the directory an out_dirs entry of None stands for)
    # what one file costs the filesystem alone, before any engine runs: create, write one sample's
    # bytes, rename (the pipeline's own write_parts), in CPU time of the writing thread
    sample_bytes = _sample_bytes(path, lengths, getattr(torch, a.dtype).itemsize, a.layers)
    file_cost = {d or default_dir: _file_cost_us(out_roots[d], sample_bytes) for d in out_dirs}
    print(
        f"filesystem cost per file (create + write + rename, CPU us; one sample = {sample_bytes:,} B):",
        json.dumps(file_cost),
    )
    jsonl = os.path.join(tmp, "in.jsonl")
    with open(jsonl, "w") as f:
        for p in prompts:
            f.write(json.dumps({"input_ids": p}) + "\n")

    llm_args = dict(
        model=path, enforce_eager=True, enable_prefix_caching=False, seed=0, distributed_executor_backend="mp", **common
    )

    def make_raw():
        from vllm import LLM, SamplingParams

        llm = LLM(**llm_args)
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        reqs = [[{"prompt_token_ids": p} for p in b] for b in batches]
        return llm, per_batch("raw", [lambda r=r: llm.generate(r, sp, use_tqdm=False) for r in reqs])

    sds = a.states_dtypes.split(",")
    first_states: dict[str, list] = {}  # states dtype -> the first batch's states (float32, [T, L, H] each)

    def sd_tag(sd):
        return "" if sd == "auto" else f"[{sd}]"

    def make_ours(sd="auto"):
        gen = VllmHiddenStatesGenerator(path, layer_ids=layer_ids, states_dtype=sd, **common)
        # like a consumer that saves each batch and drops it
        return gen, per_batch(f"generate[{dev}]{sd_tag(sd)}", [lambda b=b: gen.generate(b) for b in batches])

    def keep_first(gen, sd):  # untimed: the first batch's states, dequantized, for the error report
        if sd in first_states:
            return
        out = []
        for r in gen.generate(batches[0]):
            st = torch.stack([h.float() for h in r["hidden_states"]], dim=1)
            if "hidden_states_scales" in r:
                st = st * r["hidden_states_scales"].float()[:, :, None]
            out.append(st.cpu())
        first_states[sd] = out

    native_info: dict = {}

    def make_native():
        """vLLM's extract_hidden_states method + its hidden-states connector: one file a prompt."""
        from vllm import LLM, SamplingParams

        store = tempfile.mkdtemp(prefix="native-", dir=out_roots[out_dirs[0]])
        # vLLM's convention (output of i layers: ours + 1), each layer once, ascending, as vLLM keeps them
        native_ids = sorted({i + 1 for i in layer_ids_resolved})
        args = native.engine_kwargs(store, native_ids, cuda)
        llm = LLM(**llm_args, **args)
        kv = args["kv_transfer_config"]
        native_info.update(layer_ids=native_ids, connector=kv["kv_connector"], complete_at_return=[])
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        reqs = [[{"prompt_token_ids": p} for p in b] for b in batches]
        written: list[tuple[str, int]] = []

        def call(r):
            outs = llm.generate(r, sp, use_tqdm=False)
            files = [(o.kv_transfer_params["hidden_states_path"], len(o.prompt_token_ids)) for o in outs]
            native_info["complete_at_return"].append(sum(native.file_complete(f) for f, _ in files) / len(files))
            written.extend(files)

        timed_calls = per_batch("native", [lambda r=r: call(r) for r in reqs])

        def run(record=True):
            written.clear()
            timed_calls(record)
            for f, _ in written:  # the run ends when its last file is whole
                native.wait_complete(f)

        def check_and_clean():  # untimed: every file's header has its prompt's shape; then delete
            want_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[a.dtype]
            for f, n in written:
                hs = json.loads(read_safetensors_header(Path(f))[0])["hidden_states"]
                if hs["shape"] != [n, len(native_ids), hidden] or hs["dtype"] != want_dtype:
                    raise RuntimeError(f"native: {f} holds {hs}, expected [{n}, {len(native_ids)}, {hidden}]")
            native_info["files_checked"] = native_info.get("files_checked", 0) + len(written)
            shutil.rmtree(store, ignore_errors=True)
            os.makedirs(store, exist_ok=True)

        def first_batch_states():
            from safetensors.torch import load_file

            return [load_file(f)["hidden_states"] for f, _ in written[: len(batches[0])]]

        return llm, run, check_and_clean, first_batch_states

    def compare_native(ours_first):  # ours (list of dicts) vs native's files, first batch, every layer
        nat = native_info.pop("first_batch", None)
        if nat is None:
            return
        worst = worst_rel = 0.0
        for o, n in zip(ours_first, nat):
            for lid, h in zip(layer_ids_resolved, o["hidden_states"], strict=True):
                col = native_info["layer_ids"].index(lid + 1)
                d = (h.float() - n[:, col].float()).abs().max().item()
                worst = max(worst, d)
                worst_rel = max(worst_rel, d / max(h.float().abs().max().item(), 1e-30))
        native_info["max_abs_diff_vs_ours"] = worst
        native_info["max_rel_diff_vs_ours"] = worst_rel  # per sample and layer: max |diff| / max |ours|
        native_info["bit_identical"] = worst == 0.0
        print(f"native vs ours, first batch, every layer: max |diff| = {worst} (relative {worst_rel:.2e})")

    breakdown: dict[str, list[dict]] = {}  # pipeline runs: seconds in generate() and waiting on writers

    def pipeline_fn(gen, wt=None, wm="auto", name=None, ck="crc32", fmt="pt", shard=1, ptw=None, od=out_dirs[0]):
        if ptw is not None:  # read when the writer processes start (a change restarts them)
            os.environ["SPECULATORS_COMPAT_PT_WRITER"] = ptw
        if wm == "process" or (wm == "auto" and cuda):  # a new pool size restarts the processes:
            from speculators_compat.pipeline.writers.processes import (
                writer_pool,  # start them outside the timing
            )

            writer_pool(wt).wait_ready()

        def run():  # -> seconds in run_extract (not the clean-up: deleting GBs of output is no part of it)
            out = tempfile.mkdtemp(prefix="out-", dir=out_roots[od])
            t = time.perf_counter()
            s = run_extract(
                path,
                jsonl,
                out,
                batch_size=a.batch,
                generator=gen,
                progress=False,
                writer_threads=wt,
                writer=wm if shard == 1 else "thread",
                checksum=ck,
                fmt=fmt,
                shard_size=shard,
            )
            total = time.perf_counter() - t
            shutil.rmtree(out)
            if name:
                parts = {
                    k: s[k]
                    for k in (
                        "generate_s",
                        "read_s",
                        "handoff_s",
                        "writer_wait_s",
                        "writer_tail_s",
                        "writer_start_s",
                        "sync_s",
                        "prepare_s",
                        "finish_s",
                    )
                }
                breakdown.setdefault(name, []).append(
                    {
                        "total_s": round(total, 3),
                        "bytes_per_token": round(s["bytes"] / max(s["tokens_computed"], 1), 1),
                        **parts,
                        "other_s": round(total - sum(parts.values()), 3),
                        "writer": s["writer"],
                        "write_mib_per_s": s["write_mib_per_s"],
                        "write_bound": s["write_bound"],
                        # files written in writer processes (the rest: rows split over engine steps, in the driver)
                        "files_by_writer_processes": s.get("files_by_writer_processes"),
                        "files": s["files"],
                    }
                )
            return total

        return run

    # the plain write of the run's unquantized bytes, a file a prompt, to each output directory
    plain_sizes = [n * hidden * len(layer_ids_resolved) * getattr(torch, a.dtype).itemsize for n in lengths]

    def time_plain():
        for od in out_dirs:
            rec(f"plain[{od or default_dir}]", _plain_write_s(out_roots[od], plain_sizes))

    def rec(name, dt):  # (printed as measured: a run cut short keeps what it measured)
        times.setdefault(name, []).append(dt)
        print(f"MEASURED {name} run {len(times[name])}: {dt:.3f} s, {tokens / dt:,.0f} tokens/s", flush=True)

    slabs_made: dict[str, list[int]] = {}  # arena slabs the worker had to make during each timed run
    engine_s: dict[str, list[dict]] = {}  # per timed run: where the engine's time went (s)
    # worker_expect_s: the worker readying its arena per batch; arena_new_s: the part of it spent
    # making (on a GPU, page-locking) new slabs
    ENGINE_KEYS = (
        "prep_s",
        "busy_s",
        "expect_s",
        "drive_s",
        "handoff_s",
        "hook_s",
        "take_s",
        "worker_expect_s",
        "arena_new_s",
    )

    gc_s: dict[str, list[dict]] = {}  # per timed run: the driver's garbage collections (seconds, gen-2 count)
    gc_now = {"t0": 0.0, "s": 0.0, "full": 0}

    def on_gc(phase, info):
        if phase == "start":
            gc_now["t0"] = time.perf_counter()
        else:
            gc_now["s"] += time.perf_counter() - gc_now["t0"]
            gc_now["full"] += info.get("generation") == 2

    gc.callbacks.append(on_gc)

    def rec_run(gen, name, fn):  # time fn; note the slabs it made, the engine's time split and the driver's GC
        before = gen.engine.stats()
        gc_now.update(s=0.0, full=0)
        rec(name, fn())
        gc_s.setdefault(name, []).append({"gc_s": round(gc_now["s"], 4), "full_collections": gc_now["full"]})
        after = gen.engine.stats()
        slabs_made.setdefault(name, []).append(after.get("arena_slabs_made", 0) - before.get("arena_slabs_made", 0))
        engine_s.setdefault(name, []).append({k: round(after[k] - before[k], 3) for k in ENGINE_KEYS if k in after})

    wts = [int(x) for x in a.writer_threads.split(",")] if a.writer_threads else [None]
    wms = a.writer_modes.split(",")
    cks = a.checksums.split(",")
    ptws = a.pt_writers.split(",") if a.pt_writers else [None]
    fmts = a.formats.split(",")
    shards = [int(x) for x in a.shard_sizes.split(",")]
    outputs = [(f, n) for f in fmts for n in shards if n == 1 or f == "safetensors"]

    pipeline_tag: dict[str, str] = {}  # pipeline row -> the engine variant's tag (its generate() row's)
    pipeline_dir: dict[str, str] = {}  # pipeline row -> its output directory

    def time_pipelines(gen, tag):  # every pipeline variant asked for, once each
        timed = set()
        for wt, wm, ck, (fmt, shard), ptw, od in itertools.product(wts, wms, cks, outputs, ptws, out_dirs):
            if shard > 1:  # shards are written on a thread, whatever --writer-modes says: once
                wm = "thread"
            name = (
                "pipeline"
                + tag
                + (f"[w{wt}]" if wt else "")
                + (f"[{wm}]" if len(wms) > 1 else "")
                + (f"[{fmt}]" if len(fmts) > 1 else "")
                + (f"[s{shard}]" if len(shards) > 1 else "")
                + (f"[{ck}]" if len(cks) > 1 else "")
                + (f"[{ptw}]" if len(ptws) > 1 else "")
                + (f"[{od}]" if len(out_dirs) > 1 else "")
            )
            if name in timed:
                continue
            timed.add(name)
            pipeline_tag[name] = tag
            pipeline_dir[name] = od or default_dir
            rec_run(gen, name, pipeline_fn(gen, wt, wm, name, ck, fmt, shard, ptw, od))

    def warm_ours(gen, ours):  # the warm-up call, its first batch's rows kept for the native check
        ours(record=False)
        if native_info.get("first_batch") is not None:
            compare_native(gen.generate(batches[0]))

    def shut(llm):
        if hasattr(llm.llm_engine, "engine_core"):
            llm.llm_engine.engine_core.shutdown()

    def native_phase(nat, check_and_clean):  # one timed native run: time, then check + delete untimed
        rec("native", _timed(nat))
        check_and_clean()

    if cuda:  # all engines alive; alternate call by call
        llm, raw = make_raw()
        engines = {sd: make_ours(sd) for sd in sds}
        gen, ours = engines[sds[0]]
        if with_native:
            nllm, nat, nat_clean, nat_first = make_native()
            nat(record=False)
            native_info["first_batch"] = nat_first()
            nat_clean()
        raw(record=False)
        warm_ours(gen, ours)  # warm-up (the pipeline's too: its writer processes start once, and each
        for sd, (g, o) in engines.items():  # engine's arena gets the slabs a run asks for)
            o(record=False)
            keep_first(g, sd)
            for wm in wms:
                pipeline_fn(g, wts[0], wm)()
        for _ in range(a.reps):
            rec("raw", _timed(raw))
            time_plain()
            for sd, (g, o) in engines.items():
                rec_run(g, f"generate[{dev}]{sd_tag(sd)}", lambda o=o: _timed(o))
                time_pipelines(g, sd_tag(sd))
            if with_native:
                native_phase(nat, nat_clean)
        print("worker capture stats:", json.dumps(gen.engine.stats()))
        for g, _ in engines.values():
            g.close()
        del llm
        if with_native:
            del nllm
    else:  # CPU: one engine at a time, alternating phases
        for _phase in range(2):
            llm, raw = make_raw()
            raw(record=False)
            for _ in range(a.reps):
                rec("raw", _timed(raw))
                time_plain()
            shut(llm)
            del llm
            if with_native:
                nllm, nat, nat_clean, nat_first = make_native()
                nat(record=False)
                if _phase == 0:
                    native_info["first_batch"] = nat_first()
                nat_clean()
                for _ in range(a.reps):
                    native_phase(nat, nat_clean)
                shut(nllm)
                del nllm
            for sd in sds:
                gen, ours = make_ours(sd)
                warm_ours(gen, ours)
                keep_first(gen, sd)
                for wm in wms:
                    pipeline_fn(gen, wts[0], wm)()
                for _ in range(a.reps):
                    rec_run(gen, f"generate[{dev}]{sd_tag(sd)}", lambda ours=ours: _timed(ours))
                    time_pipelines(gen, sd_tag(sd))
                gen.close()
    fp8_error = _fp8_error(first_states, batches[0], path, layer_ids_resolved)
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, a.dtype)).to(dev).eval()
        ids = torch.tensor(prompts, device=dev)
        mb = max(1, 8192 // a.seq)

        def hf():
            with torch.no_grad():
                for i in range(0, len(prompts), mb):
                    hs = m(ids[i : i + mb], output_hidden_states=True, use_cache=False).hidden_states
                    [h.cpu() for h in hs[1::4]]
            if cuda:
                torch.cuda.synchronize()

        hf()
        for _ in range(a.reps):
            rec("hf", _timed(hf))
    shutil.rmtree(tmp, ignore_errors=True)
    for d, root in out_roots.items():
        if d:
            shutil.rmtree(root, ignore_errors=True)

    rows = {
        k: {
            "tok_s_median": tokens / statistics.median(v),
            "tok_s_min": tokens / max(v),
            "tok_s_max": tokens / min(v),
            "runs": len(v),
        }
        for k, v in times.items()
    }
    env = {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu x{os.cpu_count()}",
        "vllm": versions.installed("vllm"),
        "torch": torch.__version__,
        "model": a.model,
        "batch": a.batch,
        "batches": a.batches,
        "seq": a.seq_mixed or a.seq,
        "tokens": tokens,
        "dtype": a.dtype,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "out_dir": default_dir,
        "out_dirs": out_dirs if a.out_dirs else None,
        "file_cost_us": file_cost,
        "sample_bytes": sample_bytes,
        "layer_ids": layer_ids_resolved,
    }
    # per timed run: the first batch's tokens/s over the median of the run's other batches
    per_batch_tokens = [sum(len(p) for p in b) for b in batches]
    first_batch = {}
    if len(batches) > 1:
        for k, runs in batch_s.items():
            first_batch[k] = [
                round(
                    (per_batch_tokens[0] / ts[0])
                    / statistics.median(n / t for n, t in zip(per_batch_tokens[1:], ts[1:], strict=True)),
                    3,
                )
                for ts in runs
            ]
    print(json.dumps(env))
    print("| contender | tokens/s (median) | spread (min-max) | runs |")
    print("|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['tok_s_median']:,.0f} | {r['tok_s_min']:,.0f} - {r['tok_s_max']:,.0f} | {r['runs']} |")
    ratios = {}
    for gen_key in [k for k in rows if k.startswith("generate")]:
        ratios[f"{gen_key}/raw"] = rows[gen_key]["tok_s_median"] / rows["raw"]["tok_s_median"]
        tag = gen_key[gen_key.index("]") + 1 :]  # the variant tags after the copy mode
        for pk in [k for k in rows if pipeline_tag.get(k) == tag]:
            ratios[f"{pk}/{gen_key}"] = rows[pk]["tok_s_median"] / rows[gen_key]["tok_s_median"]
    plain_bps = _bounds(ratios, rows, times, sum(plain_sizes), pipeline_tag, pipeline_dir, breakdown)
    gen_key = next(k for k in rows if k.startswith("generate"))
    if "native" in rows:
        ratios["native/raw"] = rows["native"]["tok_s_median"] / rows["raw"]["tok_s_median"]
        ratios[f"{gen_key}/native"] = rows[gen_key]["tok_s_median"] / rows["native"]["tok_s_median"]
    if "hf" in rows:
        ratios[f"{gen_key}/hf"] = rows[gen_key]["tok_s_median"] / rows["hf"]["tok_s_median"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "env": env,
                    "rows": rows,
                    "ratios": ratios,
                    "raw_times_s": times,
                    "pipeline_breakdown_s": breakdown,
                    "arena_slabs_made": slabs_made,
                    "engine_s": engine_s,
                    "driver_gc": gc_s,
                    "batch_times_s": batch_s,
                    "first_batch": first_batch,
                    "native": native_info or None,
                    "fp8_error": fp8_error,
                    "plain_write_bytes_per_s": plain_bps,
                },
                f,
                indent=1,
            )
    for k, v in breakdown.items():
        med = {f: statistics.median(r[f] for r in v) for f in v[0] if f.endswith("_s")}
        print(f"{k}: median s per run: " + ", ".join(f"{f} {x:.3f}" for f, x in med.items()))
    print("arena slabs made per timed run:", json.dumps(slabs_made))
    for k, v in engine_s.items():  # prep: before the first step (of it, busy_s: finding lent slabs, and
        # expect_s: that plus announcing the batch to the workers; the rest: handing vLLM the requests);
        # drive: scheduling and forwards; handoff: taking the rows over
        if v and v[0]:
            print(
                f"{k}: engine median s per run: "
                + ", ".join(f"{f} {statistics.median(r[f] for r in v):.3f}" for f in v[0])
            )
    for k, v in gc_s.items():
        print(
            f"{k}: driver GC per run: median {statistics.median(r['gc_s'] for r in v):.4f} s, "
            f"full collections {[r['full_collections'] for r in v]}"
        )
    if first_batch:
        print("first batch tokens/s over the run's other batches, per timed run:", json.dumps(first_batch))
    if native_info:
        print("native:", json.dumps({k: v for k, v in native_info.items() if k != "complete_at_return"}))
        done = native_info.get("complete_at_return") or []
        if done:
            print(f"native: files complete when generate() returned: {statistics.mean(done):.1%} on average")
    for k, v in breakdown.items():
        print(f"{k}: bytes per token {v[0]['bytes_per_token']:,.1f}")
    if fp8_error:
        print("fp8 error, first batch, per layer and token (relative L2 over hidden):", json.dumps(fp8_error))
    print("ratios: " + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items()))
    return 0


def _bounds(ratios, rows, times, plain_bytes, pipeline_tag, pipeline_dir, breakdown) -> dict:
    """Into ``ratios``: each pipeline row over what bounds it, min(its engine's generate(), the plain
    write's bytes/s to its directory over the row's bytes per token); each FP8 pipeline row over the
    same row unquantized; each FP8 generate() over the unquantized one. Returns the plain write's
    bytes/s per directory (median run)."""
    plain_bps = {k[6:-1]: plain_bytes / statistics.median(v) for k, v in times.items() if k.startswith("plain[")}
    for d, bps in plain_bps.items():
        print(f"plain write to {d}: {bps / 1e9:.2f} GB/s")
    gens = {k[k.index("]") + 1 :]: k for k in rows if k.startswith("generate")}  # engine tag -> its row
    for pk, d in pipeline_dir.items():
        gk = gens.get(pipeline_tag[pk])
        if pk not in rows or gk is None:
            continue
        bound = rows[gk]["tok_s_median"]
        if d in plain_bps:
            bound = min(bound, plain_bps[d] / breakdown[pk][0]["bytes_per_token"])
        ratios[f"{pk}/min({gk},plain[{d}])"] = rows[pk]["tok_s_median"] / bound
        bf16 = pk.replace("[fp8]", "", 1)
        if bf16 != pk and bf16 in rows:
            ratios[f"{pk}/{bf16}"] = rows[pk]["tok_s_median"] / rows[bf16]["tok_s_median"]
    for tag, gk in gens.items():
        bf16 = gens.get(tag.replace("[fp8]", "", 1))
        if "[fp8]" in tag and bf16:
            ratios[f"{gk}/{bf16}"] = rows[gk]["tok_s_median"] / rows[bf16]["tok_s_median"]
    return plain_bps


def _fp8_error(first_states: dict, prompts: list, path: str, layer_ids: list) -> dict | None:
    """Worst and median relative error per (layer, token) of the FP8 states, against the
    unquantized engine's and against HF's (float32); and the unquantized states' against HF."""
    if "fp8" not in first_states or "auto" not in first_states:
        return None
    import torch

    from speculators_compat.testing.reference import HFReference

    # float32 on the GPU when there is one (the engines are shut by now); the CPU takes minutes
    ref = HFReference(path, layer_ids, device="cuda" if torch.cuda.is_available() else "cpu")

    def rel(a, b):  # [T, L, H] -> [T * L]
        return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).flatten()

    hf = [torch.stack(ref(p), dim=1) for p in prompts]
    out = {}
    for name, pairs in (
        ("fp8_vs_unquantized", zip(first_states["fp8"], first_states["auto"])),
        ("fp8_vs_hf", zip(first_states["fp8"], hf)),
        ("unquantized_vs_hf", zip(first_states["auto"], hf)),
    ):
        e = torch.cat([rel(x, y) for x, y in pairs])
        out[name] = {"worst": round(float(e.max()), 5), "median": round(float(e.median()), 5)}
    return out


if __name__ == "__main__":
    sys.exit(main())

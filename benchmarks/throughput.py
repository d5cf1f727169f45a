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

import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # native.py, writer.py beside this file
import native  # noqa: E402
import throughput_args  # noqa: E402
import throughput_report  # noqa: E402
import writer  # noqa: E402


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


# the engine's own split of its time (ExtractionEngine.stats()), kept per timed run. prep: before the
# first step (of it, busy_s: finding lent slabs, and expect_s: that plus announcing the batch to the
# workers; the rest: handing vLLM the requests); drive: scheduling and forwards; handoff: taking the
# rows over; worker_expect_s: the worker readying its arena per batch; arena_new_s: the part of it
# spent making (on a GPU, page-locking) new slabs
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
# the pipeline's run summary fields kept per timed run (pipeline/extract.py: where the time went)
RUN_KEYS = (
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


class _GcMeter:
    """The driver's garbage collections between ``reset()`` calls: seconds, and full collections."""

    def __init__(self):
        self.t0 = self.s = 0.0
        self.full = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.s += time.perf_counter() - self.t0
            self.full += info.get("generation") == 2

    def reset(self) -> None:
        self.s, self.full = 0.0, 0

    def record(self) -> dict:
        return {"gc_s": round(self.s, 4), "full_collections": self.full}


class Bench:
    """One benchmark run: the inputs and output directories (``__init__``), the contenders
    (``make_*``), the timed rounds (``run_gpu`` / ``run_cpu``, ``run_hf``) and what they recorded,
    which throughput_report.py turns into the tables, ratios and JSON."""

    def __init__(self, a):
        import torch
        from packaging.version import Version

        import speculators_compat  # noqa: F401
        from speculators_compat import versions
        from speculators_compat.layers import default_layer_ids, read_num_layers
        from speculators_compat.testing import models

        self.a, self.torch = a, torch
        self.cuda = torch.cuda.is_available()
        if self.cuda:  # the check above may initialise CUDA here: vLLM's processes must then be spawned
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        self.dev = "cuda" if self.cuda else "cpu"
        self.path = a.model if os.path.isdir(a.model) else str(models.build(a.model))
        self._prompts(models)
        self.layer_ids = [int(x) for x in a.layers.split(",")] if a.layers else None
        self.layer_ids_resolved = self.layer_ids or default_layer_ids(read_num_layers(self.path))
        self.hidden = _hidden_size(self.path)
        self.with_native = not a.no_native and Version(versions.installed("vllm")).release >= (0, 18)
        self.sds = a.states_dtypes.split(",")
        self._dirs()
        self._variants()
        # what the timed runs record
        self.times: dict[str, list[float]] = {}  # contender -> each timed run's seconds
        self.batch_s: dict[str, list[list[float]]] = {}  # per timed run: each engine call's seconds
        self.breakdown: dict[str, list[dict]] = {}  # pipeline runs: where run_extract's time went
        self.slabs_made: dict[str, list[int]] = {}  # arena slabs the worker had to make during each timed run
        self.engine_s: dict[str, list[dict]] = {}  # per timed run: where the engine's time went (ENGINE_KEYS)
        self.gc_s: dict[str, list[dict]] = {}  # per timed run: the driver's garbage collections
        self.gc = _GcMeter()
        self.native_info: dict = {}
        self.first_states: dict[str, list] = {}  # states dtype -> the first batch's states (float32, [T, L, H])
        self.pipeline_tag: dict[str, str] = {}  # pipeline row -> the engine variant's tag (its generate() row's)
        self.pipeline_dir: dict[str, str] = {}  # pipeline row -> its output directory

    # -- set-up ---------------------------------------------------------------------------------------
    def _prompts(self, models) -> None:
        a = self.a
        if a.seq_mixed:
            import random

            lo, hi = (int(x) for x in a.seq_mixed.split(","))
            rng = random.Random(7)
            self.lengths = [rng.randint(lo, hi) for _ in range(a.batch * a.batches)]
        else:
            self.lengths = [a.seq] * (a.batch * a.batches)
        self.prompts = models.random_prompts(self.lengths, seed=7)
        self.batches = [self.prompts[i : i + a.batch] for i in range(0, len(self.prompts), a.batch)]
        self.tokens = sum(self.lengths)
        self.common = dict(
            max_model_len=max(2048, max(self.lengths) + 8),
            dtype=a.dtype,
            max_num_batched_tokens=a.max_num_batched_tokens,
            gpu_memory_utilization=a.gpu_memory_utilization,
        )
        self.llm_args = dict(
            model=self.path,
            enforce_eager=True,
            enable_prefix_caching=False,
            seed=0,
            distributed_executor_backend="mp",
            **self.common,
        )

    def _dirs(self) -> None:
        """Output directories, the filesystem's cost per file in each, and the input file."""
        a, itemsize = self.a, getattr(self.torch, self.a.dtype).itemsize
        self.tmp = tempfile.mkdtemp(prefix="sc-bench-", dir=a.out_dir)
        self.out_dirs = a.out_dirs.split(",") if a.out_dirs else [None]  # None: under tmp
        self.out_roots = {d: (tempfile.mkdtemp(prefix="sc-bench-", dir=d) if d else self.tmp) for d in self.out_dirs}
        self.default_dir = a.out_dir or tempfile.gettempdir()  # (the directory an out_dirs entry of None stands for)
        # what one file costs the filesystem alone, before any engine runs: create, write one sample's
        # bytes, rename (the pipeline's own write_parts), in CPU time of the writing thread
        self.sample_bytes = _sample_bytes(self.path, self.lengths, itemsize, a.layers)
        self.file_cost = {
            d or self.default_dir: writer.file_cost_us(self.out_roots[d], self.sample_bytes) for d in self.out_dirs
        }
        print(
            f"filesystem cost per file (create + write + rename, CPU us; one sample = {self.sample_bytes:,} B):",
            json.dumps(self.file_cost),
        )
        # the plain write of the run's unquantized bytes, a file a prompt, to each output directory
        self.plain_sizes = [n * self.hidden * len(self.layer_ids_resolved) * itemsize for n in self.lengths]
        self.jsonl = os.path.join(self.tmp, "in.jsonl")
        with open(self.jsonl, "w") as f:
            for p in self.prompts:
                f.write(json.dumps({"input_ids": p}) + "\n")

    def _variants(self) -> None:
        a = self.a
        self.wts = [int(x) for x in a.writer_threads.split(",")] if a.writer_threads else [None]
        self.wms = a.writer_modes.split(",")
        self.cks = a.checksums.split(",")
        self.ptws = a.pt_writers.split(",") if a.pt_writers else [None]
        self.fmts = a.formats.split(",")
        self.shards = [int(x) for x in a.shard_sizes.split(",")]
        self.outputs = [(f, n) for f in self.fmts for n in self.shards if n == 1 or f == "safetensors"]

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        for d, root in self.out_roots.items():
            if d:
                shutil.rmtree(root, ignore_errors=True)

    # -- recording ------------------------------------------------------------------------------------
    def rec(self, name, dt):  # (printed as measured: a run cut short keeps what it measured)
        self.times.setdefault(name, []).append(dt)
        print(f"MEASURED {name} run {len(self.times[name])}: {dt:.3f} s, {self.tokens / dt:,.0f} tokens/s", flush=True)

    def rec_run(self, gen, name, fn):  # time fn; note the slabs it made, the engine's time split and the driver's GC
        before = gen.engine.stats()
        self.gc.reset()
        self.rec(name, fn())
        self.gc_s.setdefault(name, []).append(self.gc.record())
        after = gen.engine.stats()
        made = after.get("arena_slabs_made", 0) - before.get("arena_slabs_made", 0)
        self.slabs_made.setdefault(name, []).append(made)
        split = {k: round(after[k] - before[k], 3) for k in ENGINE_KEYS if k in after}
        self.engine_s.setdefault(name, []).append(split)

    def per_batch(self, name, calls):  # -> run(record): the calls in turn, each one's seconds noted
        def run(record=True):
            ts = []
            for c in calls:
                t = time.perf_counter()
                c()
                ts.append(time.perf_counter() - t)
            if record:
                self.batch_s.setdefault(name, []).append(ts)

        return run

    # -- contenders -----------------------------------------------------------------------------------
    def make_raw(self):
        from vllm import LLM, SamplingParams

        llm = LLM(**self.llm_args)
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        reqs = [[{"prompt_token_ids": p} for p in b] for b in self.batches]
        return llm, self.per_batch("raw", [lambda r=r: llm.generate(r, sp, use_tqdm=False) for r in reqs])

    def make_ours(self, sd="auto"):
        from speculators_compat import VllmHiddenStatesGenerator

        gen = VllmHiddenStatesGenerator(self.path, layer_ids=self.layer_ids, states_dtype=sd, **self.common)
        # like a consumer that saves each batch and drops it
        name = f"generate[{self.dev}]{sd_tag(sd)}"
        return gen, self.per_batch(name, [lambda b=b: gen.generate(b) for b in self.batches])

    def keep_first(self, gen, sd):  # untimed: the first batch's states, dequantized, for the error report
        if sd in self.first_states:
            return
        out = []
        for r in gen.generate(self.batches[0]):
            st = self.torch.stack([h.float() for h in r["hidden_states"]], dim=1)
            if "hidden_states_scales" in r:
                st = st * r["hidden_states_scales"].float()[:, :, None]
            out.append(st.cpu())
        self.first_states[sd] = out

    def make_native(self):
        return native.Contender(self)

    def warm_ours(self, gen, ours):  # the warm-up call, its first batch's rows kept for the native check
        ours(record=False)
        if self.native_info.get("first_batch") is not None:
            self.compare_native(gen.generate(self.batches[0]))

    def compare_native(self, ours_first):  # ours (list of dicts) vs native's files, first batch, every layer
        info = self.native_info
        nat = info.pop("first_batch", None)
        if nat is None:
            return
        worst = worst_rel = 0.0
        for o, n in zip(ours_first, nat):
            for lid, h in zip(self.layer_ids_resolved, o["hidden_states"], strict=True):
                col = info["layer_ids"].index(lid + 1)
                d = (h.float() - n[:, col].float()).abs().max().item()
                worst = max(worst, d)
                worst_rel = max(worst_rel, d / max(h.float().abs().max().item(), 1e-30))
        info["max_abs_diff_vs_ours"] = worst
        info["max_rel_diff_vs_ours"] = worst_rel  # per sample and layer: max |diff| / max |ours|
        info["bit_identical"] = worst == 0.0
        print(f"native vs ours, first batch, every layer: max |diff| = {worst} (relative {worst_rel:.2e})")

    # -- the pipeline ---------------------------------------------------------------------------------
    def pipeline_fn(self, gen, od, wt=None, wm="auto", name=None, ck="crc32", fmt="pt", shard=1, ptw=None):
        """-> run(): seconds in run_extract (not the clean-up: deleting GBs of output is no part of
        it), its summary's split kept under ``name``."""
        from speculators_compat.pipeline.extract import run_extract

        if ptw is not None:  # read when the writer processes start (a change restarts them)
            os.environ["SPECULATORS_COMPAT_PT_WRITER"] = ptw
        if wm == "process" or (wm == "auto" and self.cuda):  # a new pool size restarts the processes:
            from speculators_compat.pipeline.writers.processes import writer_pool

            writer_pool(wt).wait_ready()  # start them outside the timing
        root = self.out_roots[od]

        def run():
            out = tempfile.mkdtemp(prefix="out-", dir=root)
            t = time.perf_counter()
            s = run_extract(
                self.path,
                self.jsonl,
                out,
                batch_size=self.a.batch,
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
                self.breakdown.setdefault(name, []).append(_run_split(s, total))
            return total

        return run

    def pipeline_names(self, tag):  # -> (name, variant) for every pipeline variant asked for
        seen = set()
        for wt, wm, ck, (fmt, shard), ptw, od in itertools.product(
            self.wts, self.wms, self.cks, self.outputs, self.ptws, self.out_dirs
        ):
            if shard > 1:  # shards are written on a thread, whatever --writer-modes says: once
                wm = "thread"
            name = "pipeline" + tag
            for on, part in (
                (wt, f"[w{wt}]"),
                (len(self.wms) > 1, f"[{wm}]"),
                (len(self.fmts) > 1, f"[{fmt}]"),
                (len(self.shards) > 1, f"[s{shard}]"),
                (len(self.cks) > 1, f"[{ck}]"),
                (len(self.ptws) > 1, f"[{ptw}]"),
                (len(self.out_dirs) > 1, f"[{od}]"),
            ):
                name += part if on else ""
            if name not in seen:
                seen.add(name)
                yield name, (wt, wm, ck, fmt, shard, ptw, od)

    def time_pipelines(self, gen, tag):  # every pipeline variant asked for, once each
        for name, (wt, wm, ck, fmt, shard, ptw, od) in self.pipeline_names(tag):
            self.pipeline_tag[name] = tag
            self.pipeline_dir[name] = od or self.default_dir
            self.rec_run(gen, name, self.pipeline_fn(gen, od, wt, wm, name, ck, fmt, shard, ptw))

    def warm_pipelines(self, gen):  # its writer processes start once; the engine's arena gets its slabs
        for wm in self.wms:
            self.pipeline_fn(gen, self.out_dirs[0], self.wts[0], wm)()

    def time_plain(self):
        for od in self.out_dirs:
            self.rec(f"plain[{od or self.default_dir}]", writer.plain_write_s(self.out_roots[od], self.plain_sizes))

    # -- the rounds -----------------------------------------------------------------------------------
    def run_gpu(self) -> None:
        """Every engine alive at once; the contenders alternate call by call, ``--reps`` rounds."""
        llm, raw = self.make_raw()
        engines = {sd: self.make_ours(sd) for sd in self.sds}
        gen, ours = engines[self.sds[0]]
        nat = self.make_native() if self.with_native else None
        if nat is not None:
            nat.warm()
        raw(record=False)
        self.warm_ours(gen, ours)
        for sd, (g, o) in engines.items():
            o(record=False)
            self.keep_first(g, sd)
            self.warm_pipelines(g)
        for _ in range(self.a.reps):
            self.rec("raw", _timed(raw))
            self.time_plain()
            for sd, (g, o) in engines.items():
                self.rec_run(g, f"generate[{self.dev}]{sd_tag(sd)}", lambda o=o: _timed(o))
                self.time_pipelines(g, sd_tag(sd))
            if nat is not None:
                nat.timed_run()
        print("worker capture stats:", json.dumps(gen.engine.stats()))
        for g, _ in engines.values():
            g.close()
        del llm
        if nat is not None:
            nat.close()

    def run_cpu(self) -> None:
        """One engine at a time (an idle vLLM CPU engine's workers still poll), two phases of raw,
        native and ours in turn, ``--reps`` runs each."""
        for phase in range(2):
            llm, raw = self.make_raw()
            raw(record=False)
            for _ in range(self.a.reps):
                self.rec("raw", _timed(raw))
                self.time_plain()
            native.shut(llm)
            del llm
            if self.with_native:
                nat = self.make_native()
                nat.warm(keep_first=phase == 0)
                for _ in range(self.a.reps):
                    nat.timed_run()
                nat.close()
            for sd in self.sds:
                gen, ours = self.make_ours(sd)
                self.warm_ours(gen, ours)
                self.keep_first(gen, sd)
                self.warm_pipelines(gen)
                for _ in range(self.a.reps):
                    self.rec_run(gen, f"generate[{self.dev}]{sd_tag(sd)}", lambda ours=ours: _timed(ours))
                    self.time_pipelines(gen, sd_tag(sd))
                gen.close()

    def run_hf(self) -> None:
        """HF transformers' forward with output_hidden_states, micro-batched, ``--reps`` runs."""
        from transformers import AutoModelForCausalLM

        torch, a = self.torch, self.a
        m = AutoModelForCausalLM.from_pretrained(self.path, torch_dtype=getattr(torch, a.dtype)).to(self.dev).eval()
        ids = torch.tensor(self.prompts, device=self.dev)
        mb = max(1, 8192 // a.seq)

        def hf():
            with torch.no_grad():
                for i in range(0, len(self.prompts), mb):
                    hs = m(ids[i : i + mb], output_hidden_states=True, use_cache=False).hidden_states
                    [h.cpu() for h in hs[1::4]]
            if self.cuda:
                torch.cuda.synchronize()

        hf()
        for _ in range(a.reps):
            self.rec("hf", _timed(hf))


def sd_tag(sd):
    return "" if sd == "auto" else f"[{sd}]"


def _run_split(s: dict, total: float) -> dict:
    """A pipeline run's summary, as kept per timed run: where its time went, and its bytes."""
    parts = {k: s[k] for k in RUN_KEYS}
    return {
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


def main(argv=None) -> int:
    a = throughput_args.parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    bench = Bench(a)
    bench.run_gpu() if bench.cuda else bench.run_cpu()
    fp8_error = throughput_report.fp8_error(bench)
    if not a.no_hf:
        bench.run_hf()
    bench.cleanup()
    throughput_report.report(bench, fp8_error)
    return 0


if __name__ == "__main__":
    sys.exit(main())

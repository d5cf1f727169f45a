"""``speculators-compat extract``: dataset -> fixed batches -> generator -> background writer.

Batches are fixed partitions of the sample indices (``[k*B, (k+1)*B)``), whatever was done before,
so a resumed run feeds the engine exactly the batches an uninterrupted run would: a batch that is
partly on disk is recomputed whole and only its missing samples are written. That is what makes
a resumed dataset byte-identical to an uninterrupted one (the engine is deterministic for a given
batch; the scheduler splits it the same way).

A run goes through named phases (``_Extraction``): ``before_engine`` (the model, layer ids, the
whole input and the output's record, all checked without an engine), ``start_engine``,
``open_writer`` (the one writer decision: ``writer_mode``), ``loop`` (the batches, with the
over-length policy in ``_prompt``) and ``finish`` (manifest, summary, records).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from .. import versions
from ..engine.fp8 import SCALES_KEY
from ..engine.shm import report_orphan_shm
from ..errors import DatasetError, OutputError, TokenIdError
from ..files.registry import get_format
from .dataset import InputScan, Sample, check_unchanged, open_dataset, scan_input
from .options import ExtractOptions
from .output.layout import Layout
from .output.outdir import OutputDir
from .preflight import check_free_space, disk_full, disk_full_error, dtype_name, warn_if_write_bound, warn_overlength
from .progress import progress_bar
from .ranks import forget_launcher_env, partition_unit, pick_local_devices, resolve_part
from .reading import Prefetch, batches_of

logger = logging.getLogger("speculators_compat.pipeline")


def writer_mode(opts: ExtractOptions, generator, gpu_host: bool) -> str:
    """Threads or processes for the files: as asked, else processes on a GPU host whose engine
    lends its rows (the driver's spinning thread then starves writer threads of the GIL), threads
    elsewhere (a CPU engine needs the cores, and files are small against its compute). Asked once
    before the engine starts (``generator`` None: whether to start the writer processes early) and
    once after."""
    if opts.shard_size > 1:
        return "thread"  # (shards are written on threads: writers/shards.py)
    if opts.writer != "auto":
        return opts.writer
    return "process" if gpu_host and (generator is None or generator.engine.lends_rows) else "thread"


def run_extract(
    model: str,
    input_path: str,
    output: str,
    options: ExtractOptions | None = None,
    *,
    generator=None,
    rank: int | None = None,
    world_size: int | None = None,
    **kw,
) -> dict[str, Any]:
    """Extract ``input_path`` into ``output`` (module docstring) with ``options`` (or its fields, and
    engine settings, as keywords). Everything that can be checked without an engine is checked
    before one starts: the output directory (held with a lock; another run's output refused), the
    model's files, and the whole input. ``generator``: an engine already running (its own settings
    then apply). ``rank``/``world_size``: compute only that part of the dataset (ranks.py; None: from
    a launcher's environment, else all of it)."""
    opts = ExtractOptions.given(options, kw)
    model, input_path, output = (os.fspath(p) for p in (model, input_path, output))
    opts.check(input_path, output)
    part = resolve_part(rank, world_size)
    unit = partition_unit(opts.batch_size, opts.shard_size) if part.sharded else opts.batch_size
    if part.local_size:  # (several shards on this host from one launcher: each its own GPUs)
        pick_local_devices(part, opts.devices_per_engine)
    if part.source.endswith("(torchrun)"):
        forget_launcher_env()
    out = OutputDir(Layout.of(output, opts.fmt).states, opts.fmt, opts.checksum, opts.shard_size, part, unit)
    out.lock()  # (a second run into this output is refused here, naming the first)
    try:
        return _Extraction(out, model, input_path, opts, generator).run()
    finally:
        out.unlock()


@dataclass
class _Counts:
    """What the batch loop did: counts, and where its time went (seconds)."""

    seen: int = 0
    skipped_done: int = 0
    computed: int = 0
    written_new: int = 0
    tokens: int = 0
    truncated: list[int] = field(default_factory=list)
    skipped_overlength: list[int] = field(default_factory=list)
    hidden_size: int | None = None
    generate_s: float = 0.0
    put_s: float = 0.0
    read_s: float = 0.0


class _Extraction:
    """One run into a locked output, phase by phase (module docstring)."""

    def __init__(self, out: OutputDir, model: str, input_path: str, opts: ExtractOptions, generator):
        self.out, self.model, self.input_path, self.opts = out, model, input_path, opts
        self.generator, self.own_generator = generator, False
        self.counts = _Counts()

    def run(self) -> dict[str, Any]:
        self.t0 = time.time()
        self.before_engine()
        self.prepare_s = time.time() - self.t0
        try:
            self.start_engine()
            self.t_compute = time.time()  # throughput counts from here: engine start-up is reported apart
            self.open_writer()
            self.loop()
            return self.finish()
        finally:
            if self.own_generator:  # ours to close: its workers and /dev/shm arena go with it
                self.generator.close()

    # -- before any engine: the model's files, the whole input, the output's record -------------------
    def before_engine(self) -> None:
        from ..checkpoint import check_checkpoint, check_max_model_len, model_limits
        from ..layers import read_num_layers
        from ..layers import resolve as resolve_layers

        opts, eng, gen = self.opts, self.opts.engine, self.generator
        check_checkpoint(self.model)
        self.limits = model_limits(self.model)
        if gen is None:
            check_max_model_len(eng.get("max_model_len"), self.limits, self.model)
            n_layers = read_num_layers(self.model, bool(eng.get("trust_remote_code")))
            self.ids = resolve_layers(opts.layer_ids, n_layers, opts.layer_id_convention, opts.fmt)
            self.max_len = int(eng.get("max_model_len") or 2048) - 1
        else:
            self.ids, self.max_len = list(gen.layer_ids), gen.engine.max_model_len - 1
        # (a given generator's own setting applies)
        self.states_dtype = opts.states_dtype if gen is None else getattr(gen.engine, "states_dtype", "auto")
        self.scan = self._scan_input()
        self.done = self._prepare_output()
        self.owned = [i for i in range(self.scan.samples) if self.out.owns(i)]
        self.to_compute = sum(1 for i in self.owned if i not in self.done and i not in self.skip)
        dtype = eng.get("dtype") if gen is None else None
        self.planned_bytes = check_free_space(
            self.out.root,
            self.scan,
            self.to_compute,
            len(self.ids),
            self.limits.get("hidden_size"),
            dtype,
            self.states_dtype,
        )

    def _scan_input(self) -> InputScan:
        opts, max_len = self.opts, self.max_len
        scan = scan_input(self.input_path, opts.max_samples, max_len, known=self.out.recorded().get("input_scan"))
        if scan.overlength and opts.on_overlength == "error":
            i, n = scan.overlength[0]
            raise DatasetError(
                f"sample {i} has {n} tokens; at most max_model_len - 1 = {max_len} fit (use "
                f"--on-overlength truncate|skip; {len(scan.overlength)} sample(s) are over)"
            )
        scan.check_vocab(self.limits.get("vocab_size"))
        if scan.no_loss_mask:
            logger.warning(
                "%d of %d sample(s) have no loss_mask: every token of those counts in training (all ones)",
                scan.no_loss_mask,
                scan.samples,
            )
        if scan.overlength:
            what = "truncated to that length" if opts.on_overlength == "truncate" else "skipped (no file)"
            warn_overlength(scan.overlength, max_len, what)
        self.skip = {i for i, _ in scan.overlength} if opts.on_overlength == "skip" else set()
        return scan

    def _prepare_output(self) -> set[int]:
        from ..checkpoint import fingerprint_checkpoint

        opts, out, total = self.opts, self.out, self.scan.samples
        self.run_info = {
            "model": os.path.abspath(self.model) if os.path.exists(self.model) else self.model,
            "input": os.path.abspath(self.input_path),
            "layer_ids": self.ids,
            "layer_id_convention": "upstream",
            "format": opts.fmt,
            "batch_size": opts.batch_size,
            "max_model_len": self.max_len + 1,
            "on_overlength": opts.on_overlength,
            "states_dtype": self.states_dtype,
        }
        if opts.shard_size > 1:  # (only then: an output written before shards existed still resumes)
            self.run_info["shard_size"] = opts.shard_size
        if out.part.sharded:  # (likewise: absent means one engine)
            self.run_info["world_size"] = out.part.world_size
        out.check_total(total)
        known = (out.recorded().get("fingerprints") or {}).get("model")
        fingerprints = {"model": fingerprint_checkpoint(self.model, known), "input": self.scan.fingerprint}
        latest = {"samples": total, "skipped_overlength": sorted(self.skip), "input_scan": self.scan.record()}
        done = out.prepare(self.run_info, total, fingerprints, verify_existing=opts.verify_existing, latest=latest)
        report_orphan_shm()  # (killed engines' shared memory: said, with the command that removes it)
        asked = dtype_name(opts.engine.get("dtype")) if self.generator is None else None
        if asked:  # (an explicit --dtype is known now; "auto" only once the engine resolved it)
            out.confirm({"dtype": asked}, record=False)
        return done

    # -- the engine (not started when nothing is left to compute) ------------------------------------
    def start_engine(self) -> None:
        from ..host import cuda_device_count

        opts, gen = self.opts, self.generator
        self.gpu_host = cuda_device_count() > 0
        # the engine's workers on this host's devices (tensor x pipeline parallel)
        pc = gen.vllm_config.parallel_config if gen is not None else None
        self.tp = pc.tensor_parallel_size * pc.pipeline_parallel_size if pc is not None else opts.devices_per_engine
        if self.to_compute and writer_mode(opts, gen, self.gpu_host) == "process":
            from .writers.processes import writer_pool

            writer_pool(opts.writer_threads, self.tp)  # start the writer processes now: they import torch meanwhile
        if gen is None and self.to_compute:
            from ..generator import VllmHiddenStatesGenerator

            self.generator = VllmHiddenStatesGenerator(
                self.model,
                layer_ids=self.ids,
                layer_id_convention="upstream",
                on_overlength="error",
                self_check=opts.self_check,
                **opts.engine,
            )
            self.own_generator = True
        if self.generator is not None:
            self.dtype = str(self.generator.vllm_config.model_config.dtype).replace("torch.", "")
            self.out.confirm({"dtype": self.dtype})
            self.max_len = min(self.max_len, self.generator.engine.max_model_len - 1)  # (vLLM may lower it)

    def open_writer(self) -> None:
        from .writers.processes import ProcessWriter
        from .writers.shards import ShardWriter
        from .writers.threads import BackgroundWriter

        opts, out, gen = self.opts, self.out, self.generator
        self.mode = "thread" if gen is None else writer_mode(opts, gen, self.gpu_host)
        if opts.shard_size > 1:
            self.writer = ShardWriter(out, opts.queue_size, opts.writer_threads)
        elif self.mode == "process":
            self.writer = ProcessWriter(
                out, gen.engine.describe, opts.queue_size, opts.writer_threads, gpu_workers=self.tp
            )
        else:
            self.writer = BackgroundWriter(out, opts.queue_size, opts.writer_threads)

    # -- the batches ----------------------------------------------------------------------------------
    def loop(self) -> None:
        opts, engine = self.opts, self.generator.engine if self.generator is not None else None
        if engine is not None:
            # the worker's arena: one slab per batch the writer may hold, plus the one being
            # computed, made at the first batch (not one by one, mid-run, as the writers fall behind)
            left = len(self.owned) - len(self.done)
            engine.set_arena_slabs(min(max(1, opts.queue_size) + 2, max(1, -(-left // opts.batch_size))))
            self.check_before, check_was = engine.self_check_stats.as_dict(), engine.self_check
            engine.self_check = opts.self_check  # (a given generator's own setting comes back afterwards)
        samples = open_dataset(self.input_path)
        if opts.max_samples is not None:
            samples = islice(samples, opts.max_samples)
        bar = progress_bar(len(self.owned), opts.progress)
        batches = Prefetch(batches_of(samples, opts.batch_size))
        try:
            while (batch := self._next(batches)) is not None:
                self._one_batch(batch, bar)
            self.writer.finish(self.counts.seen)  # (shards: the last one, however short, may be written)
            check_unchanged(self.input_path, self.scan, final=True)  # (before a manifest says the dataset is whole)
        except OutputError as e:
            if not disk_full(e):
                raise
            w = self.writer
            left = self.to_compute - w.written
            raise disk_full_error(self.out.root, left, w.written, w.bytes_written, self.planned_bytes) from e
        finally:
            if engine is not None:
                engine.set_arena_slabs(0)  # later plain generate() calls hold nothing: slabs made as needed
                engine.self_check = check_was
            batches.close()
            bar.close()
            self._close_writer()
        self.t_written = time.time()  # the last file written (before the manifest and its sync)

    def _next(self, batches: Prefetch) -> list[Sample] | None:
        t = time.perf_counter()
        try:
            batch = batches.next()
        except DatasetError:
            check_unchanged(self.input_path, self.scan)  # (a line torn by a rewrite: the rewrite is the news)
            raise
        self.counts.read_s += time.perf_counter() - t  # (waiting for it: reading overlaps the engine)
        check_unchanged(self.input_path, self.scan)  # (after the batch was read: a change during it shows)
        return batch

    def _one_batch(self, batch: list[Sample], bar) -> None:
        c = self.counts
        c.seen += len(batch)
        if not self.out.owns(batch[0].index):
            return  # another rank's batch (a batch never spans two ranks' units)
        todo = [s for s in batch if s.index not in self.done and s.index not in self.skip]
        # a batch partly on disk is computed whole (the engine's numbers depend on the batch's
        # make-up: a resume must feed it the batches an uninterrupted run would) and only its
        # missing samples are written
        keep = [(s, p) for s in batch if (p := self._prompt(s)) is not None] if todo else []
        if keep:
            t = time.perf_counter()
            try:
                results = self.generator.generate([ids for _, (ids, _) in keep])
            except TokenIdError as e:  # name the sample, not its place in the batch
                raise DatasetError(e.message(f"sample {keep[e.seq][0].index}")) from e
            c.generate_s += time.perf_counter() - t
            items = [self._item(s, r, m) for (s, (_, m)), r in zip(keep, results) if s.index not in self.done]
            c.computed += len(keep)
            c.written_new += len(items)
            t = time.perf_counter()
            self.writer.put(items, upto=c.seen)  # every index below c.seen is handed over
            c.put_s += time.perf_counter() - t
        c.skipped_done += len(batch) - len(todo)
        bar.update(len(batch))
        if keep:
            bar.set_postfix_str(f"{c.tokens / max(time.time() - self.t_compute, 1e-9):,.0f} tok/s", refresh=False)

    def _prompt(self, s: Sample) -> tuple[list[int], list[int] | None] | None:
        """The over-length policy, the one place it applies: (ids, loss mask) to compute, or None
        for a sample skipped. (The scan already refused or listed every over-long sample; here the
        limit is the engine's, which vLLM may have lowered.)"""
        x, m = s.input_ids, s.loss_mask
        if len(x) <= self.max_len:
            return x, m
        if self.opts.on_overlength == "error":
            raise DatasetError(
                f"sample {s.index} has {len(x)} tokens; at most max_model_len - 1 = {self.max_len} fit "
                "(use --on-overlength truncate|skip)"
            )
        if self.opts.on_overlength == "skip":
            self.counts.skipped_overlength.append(s.index)
            return None
        self.counts.truncated.append(s.index)
        return x[: self.max_len], (m[: self.max_len] if m is not None else None)

    def _item(self, s: Sample, r: dict, mask) -> tuple[int, dict]:
        import torch

        from ..generator import token_tensor

        n = len(r["input_ids"])
        self.counts.tokens += n
        if self.counts.hidden_size is None:  # (recorded: a later run with nothing to compute reports it)
            self.counts.hidden_size = int(r["hidden_states"][0].shape[-1])
            self.out.confirm({"hidden_size": self.counts.hidden_size})
        lm = token_tensor(mask) if mask is not None else torch.ones(n, dtype=torch.long)
        item = {"input_ids": r["input_ids"], "hidden_states": r["hidden_states"], "loss_mask": lm}
        if SCALES_KEY in r:  # FP8 states (engine/fp8.py); a pt file dequantizes to the model's dtype
            item[SCALES_KEY], item["dequantize_dtype"] = r[SCALES_KEY], self.dtype
        return s.index, item

    def _close_writer(self) -> None:
        try:
            self.writer.close()
        except Exception as e:  # don't mask the original error; report the writer's own failure
            if sys.exc_info()[0] is None:
                raise
            logger.error("writer failed while handling another error: %s", e)

    # -- the end: manifest (or this rank's done.json), summary, records --------------------------------
    def finish(self) -> dict[str, Any]:
        out, c = self.out, self.counts
        extra = self._extra()
        if out.part.sharded:  # this rank's files; the manifest comes when every rank is done
            mine = out.checksum_records().values()
            files_now, bytes_now = len(mine), sum(r["bytes"] for r in mine)
        else:
            manifest = out.finalize(c.seen, extra=extra)
            files_now, bytes_now = manifest["num_files"], manifest["total_bytes"]
        summary = self._summary(files_now, bytes_now)
        if out.part.sharded:
            summary.update(rank=out.part.rank, world_size=out.part.world_size)
            out.mark_done(c.seen, extra, summary)
            summary["dataset_complete"] = out.finalize_if_complete() is not None or out.manifest_path.exists()
            if summary["dataset_complete"]:
                logger.info("%s: every rank is done; manifest.json written for the whole dataset", out.part.label)
            else:
                waiting = sorted(set(range(out.part.world_size)) - set(out.ranks_done()))
                logger.info("%s done; the dataset waits for rank(s) %s", out.part.label, ", ".join(map(str, waiting)))
        with open(out.records / "runs.jsonl", "a") as f:  # timings live here, not in the manifest
            f.write(json.dumps(summary) + "\n")
        return summary

    def _extra(self) -> dict[str, Any]:
        """What the manifest says of the run beside its files."""
        extra = {
            "model": self.run_info["model"],
            "layer_ids": self.run_info["layer_ids"],
            "num_samples": self.counts.seen,
            "truncated": [i for i, _ in self.scan.overlength] if self.opts.on_overlength == "truncate" else [],
            "skipped_overlength": sorted(self.skip),
            "versions": versions.report(),
            "hidden_size": self.counts.hidden_size or self.out.recorded().get("hidden_size"),
        }
        if get_format(self.opts.fmt).layer_ids == "eagle3":  # (its trainer's config names them as vLLM does)
            extra["layer_ids_vllm"] = [i + 1 for i in self.ids]
        return extra

    def _summary(self, files_now: int, bytes_now: int) -> dict[str, Any]:
        c, w, opts = self.counts, self.writer, self.opts
        now = time.time()
        write_s = self.t_written - self.t_compute  # from the first batch to the last file written
        write_mib_s = w.bytes_written / 2**20 / max(write_s, 1e-9)
        engine = self.generator.engine if self.generator is not None else None
        summary = {
            "output": str(self.out.root),
            "samples": c.seen,
            "files": files_now,
            "new_files": c.written_new,
            "already_done": c.skipped_done,
            "swept_temporaries": self.out.swept,
            "computed": c.computed,
            "tokens_computed": c.tokens,
            "bytes": bytes_now,
            "seconds": round(now - self.t0, 2),
            "engine_start_s": round(self.t_compute - self.t0, 2),
            "tokens_per_s": round(c.tokens / max(now - self.t_compute, 1e-9), 1),
            "truncated": len(c.truncated),
            "skipped_overlength": len(c.skipped_overlength),
            "writer": self.mode,
            "batch_size": opts.batch_size,
            **({"shard_size": opts.shard_size} if opts.shard_size > 1 else {}),
            # where the time went (s): engine calls, reading input, handing batches to the writer,
            # waiting for it while batches were in flight, and for the last writes; waiting for
            # writer processes to start (their torch import: not the disk); writing back what the
            # page cache still held, before the manifest (the disk's pace)
            "generate_s": round(c.generate_s, 3),
            "read_s": round(c.read_s, 3),
            "handoff_s": round(c.put_s - w.wait_s - w.start_wait_s, 3),
            "writer_wait_s": round(w.wait_s, 3),
            "writer_tail_s": round(w.tail_s, 3),
            "writer_start_s": round(w.start_wait_s, 3),
            "sync_s": round(self.out.sync_s, 3),
            # before the engine: the model's fingerprint, the input's scan, the output's record; after
            # the last file: the manifest (its final sync apart)
            "prepare_s": round(self.prepare_s, 3),
            "finish_s": round(now - self.t_written - self.out.sync_s, 3),
            "bytes_written": w.bytes_written,  # what this run wrote, and how fast (the compute phase)
            "write_mib_per_s": round(write_mib_s, 1),
            "write_bound": warn_if_write_bound(w.wait_s, write_s, write_mib_s, self.out.root),
            # every computed request's sampled token against its captured state (engine/selfcheck.py);
            # None: the check was off (or no engine ran)
            "self_check": engine.self_check_stats.since(self.check_before) if engine and opts.self_check else None,
        }
        if self.mode == "process":
            summary["files_by_writer_processes"] = w.in_processes
        summary["stages"] = self._stages()
        return summary

    def _stages(self) -> dict[str, Any]:
        """Where the bytes' time went, per stage, in seconds and seconds per GB written: the
        engine's calls (its hand-off of rows to host memory included), each writer stage summed over
        the writer threads or processes (files/stages.py), and the final write-back before the
        manifest (wall-clock)."""
        return self.writer.stage_times().report(engine=self.counts.generate_s, final_sync=self.out.sync_s)

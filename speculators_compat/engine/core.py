"""The one engine loop: prompts in, per-request per-layer hidden states out, in input order.

Both the patched upstream generator and our drop-in generator run on this class, so a fix for a
new vLLM release lands here once.

Shape of the loop (every version 0.11 -> 0.32):
  1. ``EngineArgs(...).create_engine_config()`` builds the VllmConfig (vLLM's own public builder:
     it fills ``is_encoder_decoder``, block sizes, chunked-prefill budgets for each version) with
     prefix caching OFF (a cache hit skips computing, so nothing would be captured) and our worker
     extension;
  2. vLLM's in-process ``EngineCore`` builds the executor, profiles memory, sizes and initialises
     the KV cache, warms up, and creates the scheduler (with the right ``block_size`` /
     ``hash_block_size`` / block hasher for the version);
  3. per ``run()``: announce (request id, prompt length) to the workers, add one max_tokens=1
     ``Request`` per prompt, and step the EngineCore until every request finished. Its step drives
     the execute_model / sample_tokens two-phase protocol (0.12+) and the async batch queue; no
     request is ever aborted mid-prefill, so chunked prefill completes;
  4. take the captures (rank 0), keyed by request id, check coverage, return in input order.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from .driver_wait import driver_wait_from_env, set_driver_wait

logger = logging.getLogger("speculators_compat.engine")

WORKER_EXTENSION = "speculators_compat.engine.worker.CaptureExtension"
ASYNC_ENV = "SPECULATORS_COMPAT_ASYNC"
ASYNC_CHOICES = ("disable", "keep")
HANDOFF_ENV = "SPECULATORS_COMPAT_HANDOFF"  # "shm" (default: files in /dev/shm) | "rpc" (pickled)
FULL_GC_SPACING = 50  # a full GC for lent rows held by garbage cycles: at most 1/50 of the time (see busy())


def _handoff_prefix(uid: str) -> str | None:
    mode = os.environ.get(HANDOFF_ENV, "shm")
    if mode not in ("shm", "rpc"):
        raise ValueError(f"{HANDOFF_ENV} must be 'shm' or 'rpc', not {mode!r}")
    if mode == "rpc":
        return None
    d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if d is None:
        logger.warning("speculators_compat: /dev/shm is not writable; captured states travel over RPC (slower)")
        return None
    sweep_stale_handoff_files(d)
    return os.path.join(d, f"speculators-compat-{uid}-")


LOCK_SUFFIX = "lock"


def hold_handoff_lock(prefix: str) -> int:
    """Create ``<prefix>lock`` and hold an exclusive flock on it for the engine's life (the fd is
    returned; closing it, or the process dying, releases it). The lock, not a pid, marks the files
    under ``prefix`` as in use: it holds across pid namespaces (containers sharing /dev/shm)."""
    import fcntl

    fd = os.open(prefix + LOCK_SUFFIX, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def sweep_stale_handoff_files(d: str) -> list[str]:
    """Remove the hand-off files of engines that are gone: a driver killed with SIGKILL cannot clean
    up, and its arena files would hold /dev/shm memory until reboot. A group of files is stale
    when its lock file exists and nobody holds the lock; a group without a lock file (an older
    release's) is left alone."""
    import fcntl

    removed: list[str] = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for lock in [n for n in names if n.startswith("speculators-compat-") and n.endswith("-" + LOCK_SUFFIX)]:
        prefix = lock[: -len(LOCK_SUFFIX)]
        try:
            fd = os.open(os.path.join(d, lock), os.O_RDWR)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: that engine is alive
            for n in names:
                if n.startswith(prefix) and n != lock:
                    try:
                        os.unlink(os.path.join(d, n))
                        removed.append(n)
                    except FileNotFoundError:
                        pass
            os.unlink(os.path.join(d, lock))  # last, while we hold it
            removed.append(lock)
        finally:
            os.close(fd)
    if removed:
        logger.info("speculators_compat: removed %d hand-off file(s) of engines that are gone from %s", len(removed), d)
    return removed


HOST_ALLOC_ENV = "SPECULATORS_COMPAT_HOST_ALLOC"
HOST_ALLOC_CHOICES = ("auto", "pinned", "malloc")
COPY_THREADS_ENV = "SPECULATORS_COMPAT_COPY_THREADS"  # threads copying states out of the arena


def copy_threads_from_env() -> int | None:
    """The thread count asked for, or None for ``auto`` (the default)."""
    raw = os.environ.get(COPY_THREADS_ENV, "auto")
    if raw == "auto":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{COPY_THREADS_ENV} must be 'auto' or a positive integer, not {raw!r}")
    return n


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def auto_copy_threads(host_alloc: str) -> int:
    """8 threads (at most half the CPUs) where the copies land in reused pinned pages (GPU hosts:
    1.6-1.8x faster than 1 thread on an H200 host, docs/gpu-results.md section 5); 1 elsewhere.
    Into fresh pages more threads were slower (page faults contend), and a CPU engine needs the
    cores itself."""
    if host_alloc != "pinned":
        return 1
    return max(1, min(8, usable_cpus() // 2))


ZERO_COPY_ENV = "SPECULATORS_COMPAT_ZERO_COPY"  # "1" (default): lend arena rows | "0": copy them out


def zero_copy_from_env() -> bool:
    raw = os.environ.get(ZERO_COPY_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{ZERO_COPY_ENV} must be '1' (lend the captured rows) or '0' (copy them), not {raw!r}")
    return raw == "1"


class _ArenaReader:
    """Driver side of the /dev/shm hand-off: maps the worker's arena files and turns its blocks
    into tensors.

    Every returned tensor has a storage of its own holding exactly its rows (so ``torch.save`` of
    one layer of one sample writes just that). Two ways to get there:

    * lending (``SPECULATORS_COMPAT_ZERO_COPY=1``, the default): a (request, layer) whose rows
      are one block in the arena (every prompt: the worker gives each one a region of its own,
      also when the scheduler splits it over steps) becomes a tensor over the driver's mapping
      of that block, no copy. Its arena file is then *busy*: the worker is told so with every
      batch and never refills it until every tensor over it is gone (counted with a finaliser on
      each lent buffer). Rows in several blocks (a step that fell back to a block of its own)
      are copied (joined).
    * copying (``=0``): every tensor is a fresh copy and the worker refills one arena each batch.

    Where copies live (``SPECULATORS_COMPAT_HOST_ALLOC``): fresh pages cost a page fault each,
    which at GPU rates (hundreds of MB per call) dominates the copy. ``pinned`` takes them from
    torch's caching pinned-memory allocator, which hands the same pages back call after call
    (needs CUDA in this process); ``malloc`` uses plain memory; ``auto`` is ``pinned`` when CUDA
    is available, else ``malloc``.
    """

    def __init__(self, mode: str | None = None, threads: int | None = None, lend: bool | None = None):
        self._maps: dict[str, Any] = {}  # path -> [mmap, uint8 tensor over it]
        self._lent: dict[str, int] = {}  # path -> live lent buffers
        self._blocks: dict[int, tuple] = {}  # storage address of a live lent buffer -> (path, offset, bytes)
        self._lent_lock = threading.RLock()  # a finaliser may run (GC) while this thread holds it
        self._next_full_gc = 0.0  # see busy()
        self.full_collections = 0
        self._pool = None
        self.threads = 1
        self.set_mode(mode)
        self.lend = zero_copy_from_env() if lend is None else bool(lend)
        threads = copy_threads_from_env() if threads is None else threads
        self.set_threads(auto_copy_threads(self.mode) if threads is None else threads)

    def set_threads(self, n: int) -> None:
        """Copy with ``n`` threads (one request's layers per task). torch releases the GIL while
        it copies; whether more threads help depends on the host (docs/gpu-results.md)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"copy threads must be a positive integer, not {n!r}")
        if self._pool is not None and n != self.threads:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.threads = n

    def set_mode(self, mode: str | None) -> None:
        mode = mode or os.environ.get(HOST_ALLOC_ENV, "auto")
        if mode not in HOST_ALLOC_CHOICES:
            raise ValueError(f"{HOST_ALLOC_ENV} must be one of {HOST_ALLOC_CHOICES}, not {mode!r}")
        if mode == "auto":
            from ..generator import cuda_device_count

            mode = "pinned" if cuda_device_count() > 0 else "malloc"
        self.mode = mode

    def _empty(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=self.mode == "pinned")

    def _map(self, path: str):
        m = self._maps.get(path)
        if m is None:
            import mmap

            import torch

            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            m = self._maps[path] = [mm, torch.frombuffer(mm, dtype=torch.uint8)]
        return m

    def busy(self, slabs=None) -> list[str]:
        """Arena files some lent tensor still lives in (the worker must not refill them).

        ``slabs``: the worker's arena files as of its last reply, when known. If one of them is
        free, the worker has somewhere to write the next batch, and nothing is collected now (a
        pipeline holds the last batch's rows in its write queue on purpose; collecting every
        call found nothing to free and cost the H200 pipeline 2% of its time). Otherwise:

        A dropped tensor can still be referenced from a garbage reference cycle (torch.save in
        torch 2.8-2.9 makes one per call that holds every storage it saved; so can the caller's
        code), and such a cycle may already sit in the oldest GC generation. When anything is
        busy the young generations are collected (cheap); when something is still busy, a full
        collection runs too, at most once per ``FULL_GC_SPACING`` times its own last duration
        (so it costs at most ~1/FULL_GC_SPACING of the run, e.g. when the caller keeps every
        result). Without it such slabs stay busy until Python's own full collection, and the
        worker grows its arena meanwhile."""
        busy = self._busy_now()
        if busy and slabs is not None and not set(slabs) <= set(busy):
            return busy
        if busy:
            import gc

            gc.collect(1)
            busy = self._busy_now()
            now = time.monotonic()
            if busy and now >= self._next_full_gc:
                gc.collect()
                done = time.monotonic()
                self._next_full_gc = done + FULL_GC_SPACING * (done - now)
                self.full_collections += 1
                busy = self._busy_now()
        return busy

    def _busy_now(self) -> list[str]:
        with self._lent_lock:
            return [p for p, n in self._lent.items() if n > 0]

    def _returned(self, path: str, ptr: int) -> None:  # a lent buffer died (any thread)
        with self._lent_lock:
            self._lent[path] -= 1
            self._blocks.pop(ptr, None)

    def describe(self, t) -> tuple | None:
        """(arena file, byte offset, rows) when ``t`` is exactly a lent block (another process can
        map it there instead of receiving the bytes); None for anything else."""
        try:
            ptr = t.untyped_storage().data_ptr()
        except (AttributeError, RuntimeError):
            return None
        with self._lent_lock:
            blk = self._blocks.get(ptr)
        if (blk is None or t.dim() != 2 or t.storage_offset() != 0 or not t.is_contiguous()
                or t.numel() * t.element_size() != blk[2]):
            return None
        return blk[0], blk[1], int(t.shape[0])

    def _lend_block(self, path: str, off: int, rows: int, hidden: int, dtype):
        import weakref

        import numpy as np
        import torch

        nbytes = rows * hidden * dtype.itemsize
        buf = np.frombuffer(self._map(path)[0], dtype=np.uint8, count=nbytes, offset=off)
        ptr = buf.ctypes.data
        with self._lent_lock:
            self._lent[path] = self._lent.get(path, 0) + 1
            self._blocks[ptr] = (path, off, nbytes)
        weakref.finalize(buf, self._returned, path, ptr)
        # the tensor's storage is exactly this block and keeps ``buf`` (and so the mapping) alive
        return torch.from_numpy(buf).view(dtype).view(rows, hidden)

    def assemble(self, blocks, hidden: int, dtype):
        import torch

        if self.lend and len(blocks) == 1:
            return self._lend_block(*blocks[0], hidden, dtype)
        es = dtype.itemsize
        views = [self._map(p)[1][o: o + n * hidden * es].view(dtype).view(n, hidden) for p, o, n in blocks]
        out = self._empty((sum(v.shape[0] for v in views), hidden), dtype)
        return torch.cat(views, dim=0, out=out) if len(views) > 1 else out.copy_(views[0])

    def assemble_all(self, states: dict, hidden: int, dtype) -> dict:
        """``{request: [tensor per layer]}`` from ``{request: [blocks per layer]}``."""
        for layers in states.values():  # map every file here, so the worker threads only read
            for blocks in layers:
                for p, _, _ in blocks:
                    self._map(p)
        copies = sum(1 for layers in states.values() for b in layers if not (self.lend and len(b) == 1))
        if self.threads == 1 or copies < 2:
            return {r: [self.assemble(b, hidden, dtype) for b in layers] for r, layers in states.items()}
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sc-copy")
        futs = {r: self._pool.submit(lambda ls: [self.assemble(b, hidden, dtype) for b in ls], layers)
                for r, layers in states.items()}
        return {r: f.result() for r, f in futs.items()}

    def forget_except(self, live) -> None:
        """Drop the mappings of arena files the worker no longer has (a lent tensor keeps its own
        mapping alive until it dies)."""
        live = set(live)
        for p in [p for p in self._maps if p not in live]:
            del self._maps[p]
        with self._lent_lock:
            for p in [p for p, n in self._lent.items() if n <= 0 and p not in live]:
                del self._lent[p]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._maps.clear()


def _params(fn) -> set:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


class CaptureError(RuntimeError):
    """Captured hidden states failed a correctness check (coverage, NaN/Inf, shape)."""


class StallError(RuntimeError):
    """The engine stopped making progress with requests still pending."""


class WorkerDiedError(RuntimeError):
    """A vLLM worker process died; the engine cannot continue (files already written are intact)."""


class TokenIdError(ValueError):
    """A sequence holds a token id the model cannot embed (negative, or at or above its vocabulary
    size). ``seq`` is its index in the batch, ``token`` the id, ``vocab`` the vocabulary size.

    Checked before anything reaches vLLM: we hand it token ids directly, past the input processor
    that checks them for ``LLM.generate``. Unchecked, such an id is an IndexError in a CPU worker, a
    device-side assert that kills the engine on CUDA, and under tensor parallelism (where each rank
    masks the ids outside its shard of the table) a row of zeros: silently wrong states."""

    def __init__(self, seq: int, token: int, vocab: int | None):
        self.seq, self.token, self.vocab = seq, token, vocab
        super().__init__(self.message(f"sequence {seq}"))

    def message(self, where: str) -> str:
        """The error, with ``where`` naming the sequence (the pipeline names its sample)."""
        if self.token < 0:
            return f"{where} holds a negative token id {self.token}"
        return (f"{where} holds token id {self.token}, outside the model's vocabulary of {self.vocab} ids "
                f"[0, {self.vocab - 1}] (tokenized for another model?)")


def model_vocab_size(vllm_config) -> int | None:
    """The number of token ids the model's (text) embedding table has, as vLLM reads it."""
    mc = vllm_config.model_config
    get = getattr(mc, "get_vocab_size", None)
    v = get() if callable(get) else getattr(getattr(mc, "hf_text_config", None), "vocab_size", None)
    return int(v) if v else None


def check_token_ids(prompts: Sequence[Sequence[int]], vocab: int | None) -> None:
    """Raise TokenIdError for the first sequence holding an id the model cannot embed."""
    for i, p in enumerate(prompts):
        if not p:
            continue
        lo = min(p)
        if lo < 0:
            raise TokenIdError(i, lo, None)
        if vocab is not None:
            hi = max(p)
            if hi >= vocab:
                raise TokenIdError(i, hi, vocab)


def resolve_async(strategy: str | None) -> str:
    s = strategy if strategy is not None else os.environ.get(ASYNC_ENV, "keep")
    if s not in ASYNC_CHOICES:
        raise ValueError(f"async scheduling strategy must be one of {ASYNC_CHOICES}, not {s!r} "
                         f"(argument async_scheduling or ${ASYNC_ENV})")
    return s


@dataclass
class EngineOptions:
    model: str
    tokenizer: str | None = None
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.8
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    quantization: str | None = None
    trust_remote_code: bool = False
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_expert_parallel: bool = False
    async_scheduling: str | None = None  # "disable" | "keep" (None: $SPECULATORS_COMPAT_ASYNC or keep)
    seed: int = 0
    enforce_eager: bool = True
    #: "fork" | "spawn" | None (spawn on CUDA hosts: see choose_start_method; elsewhere vLLM's choice, CPU: spawn)
    worker_start_method: str | None = None
    #: GPU -> host hand-off of captured rows: "pinned" (async into pinned memory) | "sync" | None (env/default)
    copy_mode: str | None = None
    engine_kwargs: dict = field(default_factory=dict)  # passed through to EngineArgs


def check_sizes(opts: EngineOptions) -> None:
    """Refuse sizes vLLM would take silently or only fail on later: ``max_num_seqs=0`` and
    ``max_num_batched_tokens=0`` ran as if unset (vLLM 0.32), and ``max_model_len=1`` started the
    engine only for every prompt to be cut to nothing (one position is kept back, as upstream does)."""
    def bad(v, least: int) -> bool:
        return isinstance(v, bool) or not isinstance(v, int) or v < least

    if bad(opts.tensor_parallel_size, 1):
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, not {opts.tensor_parallel_size!r}")
    if opts.max_model_len is not None and bad(opts.max_model_len, 2):
        raise ValueError(f"max_model_len must be an integer >= 2 (prompts keep at most max_model_len - 1 "
                         f"tokens) or None for the model's own, not {opts.max_model_len!r}")
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        v = getattr(opts, name)
        if v is not None and bad(v, 1):
            raise ValueError(f"{name} must be an integer >= 1 or None for vLLM's default, not {v!r}")


def build_vllm_config(opts: EngineOptions):
    """A VllmConfig for extraction, from vLLM's own EngineArgs (stable in every version)."""
    _pin_v1_runner()
    from vllm.engine.arg_utils import EngineArgs

    from . import facts as facts_mod

    check_sizes(opts)
    strategy = resolve_async(opts.async_scheduling)
    kw: dict[str, Any] = dict(
        model=opts.model,
        tokenizer=opts.tokenizer or opts.model,
        trust_remote_code=opts.trust_remote_code,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        enforce_eager=opts.enforce_eager,
        tensor_parallel_size=opts.tensor_parallel_size,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        worker_extension_cls=WORKER_EXTENSION,
        # Worker processes (as upstream's MultiprocExecutor): the same path for TP=1 and TP>1, and
        # a worker crash cannot take the driver down. (0.12-0.17 would pick in-process "uni".)
        distributed_executor_backend="mp",
        # A prefix-cache hit skips computing the cached positions: they would never be captured.
        enable_prefix_caching=False,
        seed=opts.seed,
        enable_expert_parallel=opts.enable_expert_parallel,
    )
    if opts.quantization:
        kw["quantization"] = opts.quantization
    if opts.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = opts.max_num_batched_tokens
    if opts.max_num_seqs:
        kw["max_num_seqs"] = opts.max_num_seqs
    if strategy == "disable":
        kw["async_scheduling"] = False
    if facts_mod.probe().engine_args_language_model_only:
        # Extraction feeds token ids only. For a multimodal wrapper (Kimi-K2.5) this leaves the
        # vision tower unbuilt and unprofiled (vLLM 0.17+; a no-op for text models).
        kw["language_model_only"] = True
    kw.update(opts.engine_kwargs)
    if kw.get("pipeline_parallel_size", 1) != 1:
        raise ValueError("pipeline parallelism is not supported for capture (layers would be split "
                         "across ranks); use tensor parallelism")
    if kw.get("enable_prefix_caching"):
        raise ValueError("enable_prefix_caching=True would skip computing cached prefixes, whose "
                         "hidden states then could not be captured")
    return EngineArgs(**kw).create_engine_config()


def _pin_v1_runner() -> None:
    """Run the V1 model runner where vLLM still has it (0.11-0.33): the runner every release of the
    matrix is tested with. Model Runner V2 (opt-in there, default for some models from 0.24 on GPU)
    is what 0.34+ has only; capture reads its per-step input batch instead (worker.runner_kind).
    A user who sets VLLM_USE_V2_MODEL_RUNNER=1 on a release that has both gets V2, said in the log."""
    from . import facts as facts_mod

    facts = facts_mod.probe()
    v = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if not facts.has_v1_runner:
        if v is not None and v.strip().lower() in ("0", "false"):
            raise RuntimeError(
                f"VLLM_USE_V2_MODEL_RUNNER={v} asks for the V1 model runner, which vLLM {facts.version} "
                "no longer has (removed in 0.34). Unset it: capture works with Model Runner V2.")
        return
    if v not in (None, "", "0", "false", "False"):
        logger.info("speculators_compat: VLLM_USE_V2_MODEL_RUNNER=%s: capturing with Model Runner V2 "
                    "(the tests run vLLM 0.11-0.33 with the V1 runner, which is pinned when it is unset)", v)
        return
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


ANNOUNCE_ENV = "SPECULATORS_COMPAT_ANNOUNCE"
ANNOUNCE_CHOICES = ("wait", "ahead")


def announce_from_env() -> str:
    """How each batch is announced to the workers before its first step (env
    SPECULATORS_COMPAT_ANNOUNCE): send it ``ahead`` of the steps that follow without waiting for
    the reply (the default; vLLM 0.12+, whose executor delivers replies in call order: the reply,
    and any error in it, is taken after the batch's steps; 0.11 falls back to waiting), or
    ``wait`` for the workers' reply first. Measured on an H200 host (docs/gpu-results.md section
    10): ahead halved the announcement's cost inside the pipeline (0.086 -> 0.043 and 0.061 ->
    0.042 s per 16 batches) and the pipeline ran 2.6-3.1% faster."""
    raw = os.environ.get(ANNOUNCE_ENV, "").strip() or "ahead"
    if raw not in ANNOUNCE_CHOICES:
        raise ValueError(f"{ANNOUNCE_ENV} must be one of {', '.join(ANNOUNCE_CHOICES)}, not {raw!r}")
    return raw


def choose_start_method(requested: str | None, cuda_devices: int, environ) -> str | None:
    """How vLLM should start the workers: ``requested`` if given; else ``spawn`` on a CUDA host unless
    ``VLLM_WORKER_MULTIPROC_METHOD`` is set; else None (vLLM's own choice).

    On a CUDA host vLLM forks unless it sees CUDA initialised, but a driver that has queried CUDA
    without initialising it can no longer fork workers that use it: they die at start-up
    ("Cannot re-initialize CUDA in forked subprocess"). Seen on the H200 (vLLM 0.20) with
    speculators 0.3.0's class + the import on Kimi-K2.5, after importing speculators; spawned
    workers started there. The script needs the usual ``if __name__ == "__main__":`` guard."""
    if requested is not None:
        if requested not in ("fork", "spawn"):
            raise ValueError(f"worker_start_method must be 'fork' or 'spawn', not {requested!r}")
        return requested
    if cuda_devices > 0 and not environ.get("VLLM_WORKER_MULTIPROC_METHOD"):
        return "spawn"
    return None


def _cuda_devices() -> int:
    from ..generator import cuda_device_count

    return cuda_device_count()


class ExtractionEngine:
    """Owns one vLLM EngineCore with our capture extension."""

    def __init__(self, opts: EngineOptions, layer_ids: Sequence[int]):
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.abstract import Executor

        from . import facts as facts_mod

        self.opts = opts
        self.layer_ids = list(layer_ids)
        self.facts = facts_mod.probe()
        t0 = time.time()
        self.vllm_config = build_vllm_config(opts)
        method = choose_start_method(opts.worker_start_method, _cuda_devices(), os.environ)
        if method is not None:
            # config creation may have forced it (the CPU platform sets spawn); ours wins
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method
        self._reader = _ArenaReader()  # reads its settings from the environment: fail before starting
        wait_mode = driver_wait_from_env()
        announce = announce_from_env()
        from .worker import arena_keep_s

        arena_keep_s()  # a bad setting fails here, not in a worker (they read it too)
        executor_class = Executor.get_class(self.vllm_config)
        self._worker_failed = False
        self.core = EngineCore(self.vllm_config, executor_class, log_stats=False,
                               executor_fail_callback=self._on_worker_failure)
        self._closed = False
        self._wait_saved: dict = {}
        self.driver_wait = self.set_driver_wait(wait_mode)
        self._lock = threading.Lock()
        self._uid = uuid.uuid4().hex[:8]
        self._calls = 0
        self._handoff_prefix = _handoff_prefix(self._uid)
        # held until shutdown: marks this engine's /dev/shm files as in use for other engines' sweeps
        self._handoff_lock = hold_handoff_lock(self._handoff_prefix) if self._handoff_prefix else None
        self.timings = {"drive_s": 0.0, "handoff_s": 0.0, "prep_s": 0.0, "busy_s": 0.0, "expect_s": 0.0}
        self._worker_slabs = None  # the worker's arena files as of its last take (None: not known)
        self.arena_slabs = 0  # batches of lent rows the caller holds at once (set_arena_slabs)
        # Does collective_rpc(unique_reply_rank=0) hand back the value (0.12+) or a 1-list (0.11)?
        # Probe the behaviour instead of trusting a version number.
        self._rpc_takes_rank = "unique_reply_rank" in _params(self.executor.collective_rpc)
        # Can a call be sent without waiting, its reply taken in order by the next call? (0.12+:
        # a queue of pending replies that every later call drains first; 0.11 needs a thread pool)
        self._can_announce_ahead = ("non_block" in _params(self.executor.collective_rpc)
                                    and hasattr(getattr(self.executor, "futures_queue", None), "pop"))
        self.announce = self.set_announce(announce, warn=bool(os.environ.get(ANNOUNCE_ENV, "").strip()))
        probe = self._rpc_rank0_raw("compat_ping")
        self._rpc_unwrap = isinstance(probe, list)
        infos = self.executor.collective_rpc("compat_capture_setup",
                                            args=(self.layer_ids, opts.copy_mode, self._handoff_prefix))
        self.model_info = infos[0]
        if not any(i.get("capturing") for i in infos):
            raise RuntimeError("speculators_compat: no worker rank captures hidden states")
        self.vocab_size = model_vocab_size(self.vllm_config)
        if self.vocab_size is None:
            logger.warning("speculators_compat: cannot read the model's vocabulary size from vLLM's "
                           "config; token ids will be checked for sign only")
        self.startup_seconds = time.time() - t0
        logger.info("engine ready in %.1fs (%s, layers %s)", self.startup_seconds,
                    self.model_info.get("model"), self.layer_ids)

    # ------------------------------------------------------------------ accessors
    @property
    def executor(self):
        return self.core.model_executor

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def max_model_len(self) -> int:
        return int(self.vllm_config.model_config.max_model_len)

    def _rpc_rank0_raw(self, method: str, *args):
        if self._rpc_takes_rank:
            return self.executor.collective_rpc(method, args=args, unique_reply_rank=0)
        return self.executor.collective_rpc(method, args=args)

    def _rpc_rank0(self, method: str, *args):
        out = self._rpc_rank0_raw(method, *args)
        return out[0] if self._rpc_unwrap else out

    # ------------------------------------------------------------------ the loop
    def run(self, prompts: Sequence[Sequence[int]], *, ids_checked: bool = False) -> list[list[Any]]:
        """Hidden states for each prompt: ``result[i][j]`` is [len(prompts[i]), hidden] for layer j.

        Token ids are checked against the vocabulary (TokenIdError) unless the caller already did
        (``ids_checked``: the drop-in generator checks them while validating the batch)."""
        if self._closed:
            raise RuntimeError("engine was shut down")
        with self._lock:
            return self._run(prompts, ids_checked)

    def _run(self, prompts, ids_checked=False):
        max_len = self.max_model_len - 1  # room for the one sampled token
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; at most max_model_len - 1 = {max_len} fit")
        if not ids_checked:
            check_token_ids(prompts, self.vocab_size)
        self._calls += 1
        t_prep = time.perf_counter()
        ids = [f"sc-{self._uid}-{self._calls}-{i}" for i in range(len(prompts))]
        busy = self._reader.busy(self._worker_slabs)
        self.timings["busy_s"] += time.perf_counter() - t_prep
        expect = ({r: len(p) for r, p in zip(ids, prompts)}, busy, self.arena_slabs if self.lends_rows else 0)
        ahead = None
        if self.announce == "ahead":  # the reply comes back in order, before the first step's
            ahead = self.executor.collective_rpc("compat_capture_expect", args=expect, non_block=True)
        else:
            self.executor.collective_rpc("compat_capture_expect", args=expect)
        self.timings["expect_s"] += time.perf_counter() - t_prep
        try:
            for rid, p in zip(ids, prompts):
                self.core.add_request(self._make_request(rid, list(p)))
            t0 = time.perf_counter()
            self.timings["prep_s"] += t0 - t_prep
            self._drive()
            if ahead is not None:
                ahead.result()  # a worker that failed to take the batch (no room for it) raises here
            t1 = time.perf_counter()
            taken = self._rpc_rank0("compat_capture_take", ids)
            taken["states"] = self._copy_out(taken)
            self.timings["drive_s"] += t1 - t0
            self.timings["handoff_s"] += time.perf_counter() - t1
        except BaseException as e:
            if self._worker_failed:
                self._closed = True
                self._cleanup_handoff()
                if isinstance(e, KeyboardInterrupt):
                    raise  # Ctrl-C / SIGTERM sent to the whole process group took the workers down too
                raise WorkerDiedError(
                    "a vLLM worker process died during extraction; this engine is unusable. Outputs "
                    "already written are complete; rerun to resume.") from e
            self._abandon(ids)
            raise
        errors = taken["errors"]
        if errors:
            detail = "; ".join(f"prompt {ids.index(r)}: {m}" for r, m in list(errors.items())[:5])
            raise CaptureError(f"{len(errors)} of {len(ids)} prompts were not fully captured: {detail}")
        return [taken["states"][r] for r in ids]

    def _copy_out(self, taken: dict) -> dict:
        """Per request, per layer tensors of their own (from the arena blocks, or as pickled)."""
        import torch

        states = taken["states"]
        if self._handoff_prefix is None:
            return states
        dtype = getattr(torch, taken["dtype"])
        # Threads: see auto_copy_threads (vLLM sets the driver's torch threads to 1, so each task
        # copies on one core).
        out = self._reader.assemble_all(states, taken["hidden"], dtype)
        self._worker_slabs = taken.get("slabs")
        self._reader.forget_except(self._worker_slabs or ())
        return out

    def _drive(self) -> None:
        core = self.core
        step = core.step_fn
        sched = core.scheduler
        # Unfinished requests only: like vLLM's own busy loop, the workers learn which requests
        # finished with the next batch's first step, instead of through an extra empty step here.
        has_work = sched.has_unfinished_requests
        idle = 0
        while has_work() or (getattr(core, "batch_queue", None) or ()):
            _, executed = step()
            idle = 0 if executed else idle + 1
            if idle > 200:
                raise StallError(
                    "the scheduler stopped scheduling with requests pending (200 steps without a "
                    "forward): a prompt may not fit the KV cache; lower the batch or raise memory")

    def _cleanup_handoff(self) -> None:
        if self._handoff_prefix:
            import glob

            for f in glob.glob(self._handoff_prefix + "*"):  # the lock file too, while we hold it
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
        if getattr(self, "_handoff_lock", None) is not None:
            os.close(self._handoff_lock)
            self._handoff_lock = None

    def _on_worker_failure(self) -> None:  # called by vLLM's worker monitor thread
        self._worker_failed = True
        logger.error("speculators_compat: a vLLM worker process died")

    def _abandon(self, ids: list[str]) -> None:
        try:
            self.core.abort_requests(ids)
            self.executor.collective_rpc("compat_capture_take", args=(ids, False))
        except Exception as e:  # the engine may be dead already; report, don't mask the real error
            logger.warning("could not clean up requests after a failure: %s", e)

    def _make_request(self, rid: str, prompt: list[int]):
        from vllm.sampling_params import SamplingParams

        from ..patches.vllm_request import build_request

        sp = SamplingParams(max_tokens=1, temperature=0.0)
        return build_request(rid, prompt, sp, block_hasher=self.core.request_block_hasher)

    # ------------------------------------------------------------------ lifecycle
    def set_host_alloc(self, mode: str) -> None:
        """Switch where copied-out states live ("pinned" | "malloc" | "auto") between runs (benchmarks)."""
        self._reader.set_mode(mode)

    @property
    def lends_rows(self) -> bool:
        """Do results come back as lent arena rows (zero-copy through /dev/shm)?"""
        return self._reader.lend and self._handoff_prefix is not None

    def describe(self, t) -> tuple | None:
        """Where a returned tensor lives, if it is lent arena rows: (file, byte offset, rows)."""
        return self._reader.describe(t)

    def set_arena_slabs(self, n: int) -> None:
        """Say how many batches' results the caller will hold at once (a pipeline: its write
        queue plus the batch being computed); with lent rows, the worker makes that many arena
        slabs at the next batch instead of one at a time mid-run, whenever the caller falls
        further behind. 0 (default): made as needed."""
        n = int(n)
        if n < 0:
            raise ValueError(f"arena slabs must be >= 0, not {n}")
        self.arena_slabs = n

    def set_zero_copy(self, on: bool) -> None:
        """Lend captured rows to the caller (True) or copy them out (False) from the next run on."""
        self._reader.lend = bool(on)

    def set_driver_wait(self, mode: str) -> list[str]:
        """``spin`` (default: vLLM's own) or ``block``: how the driver waits for replies
        (engine/driver_wait.py). Returns how each reply queue waits now."""
        self.driver_wait = set_driver_wait(self.executor, mode, self._wait_saved)
        return self.driver_wait

    def set_announce(self, mode: str, warn: bool = True) -> str:
        """``wait`` or ``ahead`` (see announce_from_env); returns the mode now in force: ``ahead``
        falls back to ``wait`` (with a warning if ``warn``) where the executor cannot send it ahead."""
        if mode not in ANNOUNCE_CHOICES:
            raise ValueError(f"announce must be one of {', '.join(ANNOUNCE_CHOICES)}, not {mode!r}")
        if mode == "ahead" and not self._can_announce_ahead:
            (logger.warning if warn else logger.info)("speculators_compat: announcing batches ahead needs vLLM 0.12+'s ordered "
                           "replies (%s has none); waiting for each announcement instead",
                           type(self.executor).__name__)
            mode = "wait"
        self.announce = mode
        return mode

    def set_copy_threads(self, n: int) -> None:
        """Threads that copy states out of the arena in the driver (benchmarks; default: auto)."""
        self._reader.set_threads(n)

    def set_copy_mode(self, mode: str) -> None:
        """Switch the GPU -> host hand-off ("pinned" or "sync") between runs (benchmarks). A switch
        re-installs the capture, so the next call builds (and page-locks) a fresh arena."""
        if mode == self.opts.copy_mode:
            return
        self.opts.copy_mode = mode
        self.executor.collective_rpc("compat_capture_setup", args=(self.layer_ids, mode, self._handoff_prefix))

    def stats(self) -> dict:
        st = dict(self._rpc_rank0("compat_capture_stats"))
        st.update({k: round(v, 3) for k, v in self.timings.items()})
        return st

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if getattr(self, "_reader", None) is not None:
            self._reader.close()
        try:
            self.core.shutdown()
        except Exception as e:
            if not sys.is_finalizing():  # at interpreter exit vLLM's own loggers may be gone
                logger.warning("engine shutdown raised: %s", e)
        self._cleanup_handoff()  # the workers are gone: remove any arena file they left

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        self.shutdown()

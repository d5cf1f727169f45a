"""Worker-side capture: runs inside every vLLM worker process, mixed into vLLM's ``Worker``.

vLLM mixes the class named by ``worker_extension_cls`` into its worker; our engine names
``speculators_compat.engine.worker.CaptureExtension`` and calls its ``compat_*`` methods through
``collective_rpc``. Nothing here depends on driver-side state: everything the capture needs is sent
with the calls (layer ids, expected prompt lengths).

How rows are attributed (the part upstream got wrong):
  * the engine tells the worker which request ids to expect and each one's prompt length;
  * every forward, the model runner gives the order of requests in the flattened token batch (the
    V1 runner: its persistent ``input_batch.req_ids``; Model Runner V2, the only one from vLLM 0.34:
    the ``InputBatch`` its ``prepare_inputs`` builds for the step, requests sorted by token count)
    and the step's ``SchedulerOutput.num_scheduled_tokens`` how many tokens each contributes; the
    ``positions`` input gives each segment's token positions;
  * each segment is stored under (request id, start position); rows at positions >= the prompt
    length (a decode step) are dropped; nothing is ever attributed by offset across requests.
``take`` orders a request's segments by position and checks that every position 0..len-1 was
captured exactly once.

Where the rows go: the hooks write each step's kept rows straight into a host arena slab (a file
in /dev/shm the driver maps; on a GPU it is registered as pinned memory, so the device->host copy
is an asynchronous DMA). When a batch is announced, each request gets its own region of the slab
per captured layer, sized to its prompt, in announcement order, and every step's rows land at
their positions in it: a prompt that the scheduler splits over several steps still ends up as one
block, and requests scheduled in announcement order make one run (one DMA) per layer and step.
``take`` copies nothing: it hands back (file, offset, rows) blocks, adjacent ones merged. The
driver lends single-block rows to its caller as tensors over its mapping (no copy) and copies the
rest (rows that fell back to per-step blocks); every batch it tells the worker which slabs still
hold lent rows, and a new batch is written only into a slab that holds none (or a new one). Free
slabs are reused, so in a loop that drops each batch's results the arena stays at a few batches'
states.

Capture happens on tensor-parallel rank 0 only (after the row-parallel all-reduce every rank holds
the full hidden state, so one copy is enough); other ranks install nothing.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ARENA_HEADROOM

logger = logging.getLogger("speculators_compat.worker")

#: GPU -> host hand-off: "pinned" (async copies into pinned host memory, one sync per take) or "sync".
COPY_MODE_ENV = "SPECULATORS_COMPAT_COPY"


def find_base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (the module with ``.layers``) inside a vLLM model.

    Handles text models (``model.model``), multimodal wrappers that expose ``get_language_model()``
    (Kimi-K2.5 in vLLM 0.16+: ``language_model.model``; 0.15: ``language_model`` is the decoder
    itself) and a bare ``language_model`` attribute.
    """
    candidates = []
    lm = None
    if hasattr(model, "get_language_model"):
        try:
            lm = model.get_language_model()
        except (AttributeError, NotImplementedError) as e:  # some wrappers raise until configured
            logger.debug("get_language_model() failed on %s: %s", type(model).__name__, e)
    for root in (lm, getattr(model, "language_model", None), model):
        if root is None:
            continue
        candidates.append(getattr(root, "model", None))
        candidates.append(root)
    for c in candidates:
        if isinstance(c, torch.nn.Module) and isinstance(getattr(c, "layers", None), torch.nn.ModuleList):
            return c
    raise RuntimeError(
        f"speculators_compat: cannot find the decoder layers of {type(model).__name__}: none of "
        "model.model, model.get_language_model()(.model) or model.language_model(.model) has a "
        "`.layers` ModuleList. This architecture is not supported for hidden-state capture."
    )


def _layer_output(output: Any) -> torch.Tensor:
    """The residual stream after a decoder layer: ``hidden_states + residual`` (pre final norm)."""
    if isinstance(output, tuple):
        hidden = output[0]
        residual = output[1] if len(output) > 1 else None
        if isinstance(residual, torch.Tensor):
            return hidden + residual
        return hidden
    return output


KEEP_S_ENV = "SPECULATORS_COMPAT_ARENA_KEEP_S"


def arena_keep_s() -> float:
    """SPECULATORS_COMPAT_ARENA_KEEP_S (see _Arena.KEEP_S); a bad value is a ValueError that names
    it (the engine checks it in the driver before any worker starts)."""
    return _env_seconds(KEEP_S_ENV, _Arena.KEEP_S)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # (NaN too)
        raise ValueError(f"{name} must be a number of seconds >= 0, not {raw!r}")
    return value


SHM_ALIGN = 64  # bytes; every block in the arena starts aligned (any dtype, vectorised copies)


class ArenaSpaceError(RuntimeError):
    """The hand-off arena could not be allocated (/dev/shm too small?)."""


class _Arena:
    """Host buffers ("slabs") the capture hooks write rows into; one slab is filled per batch.

    With ``prefix`` each slab is a file in /dev/shm (space reserved with posix_fallocate, so a
    full /dev/shm is a clear error here instead of a SIGBUS in a forward); without one it is
    process memory and the rows travel back pickled. ``pin``: register the slabs with CUDA so
    device->host copies into them are asynchronous DMAs.

    Lending: the driver may hand rows out to its caller without copying them (tensors over its
    mapping of the slab). Such a slab is *busy* until the driver reports that every tensor in it
    is gone; :meth:`prepare` never fills a busy slab, it takes a free one or makes a new one.
    Slabs are keyed by a serial number that is never reused, so a stale key cannot alias.
    """

    SPARE = 2  # free slabs kept besides the one being filled...
    RECENT = 8  # ...or as many as were in use at once within the last RECENT batches...
    KEEP_S = 30.0  # ...and the last KEEP_S seconds (env SPECULATORS_COMPAT_ARENA_KEEP_S): a burst of
    # quick calls that hold nothing (a benchmark's plain generate() runs between pipeline runs) must not
    # release the slabs a write queue needs again seconds later; a new one is a /dev/shm allocation
    # plus page-locking (0.1 s or more for the ~0.5 GB of a 32 x 1024-token batch on a GPU)
    HEADROOM = ARENA_HEADROOM  # 1.25: a slab made for a batch is sized to the largest batch seen so far times this, so
    # batches of mixed sizes soon fit the slabs already made (H200, 32 prompts of 100-2,000 tokens:
    # without it each run of 16 batches made up to 3 new slabs, ~0.3 s each); falls back to the exact
    # size where /dev/shm has no room for the headroom

    def __init__(self, prefix: str | None, pin: bool):
        self.prefix, self.pin = prefix, pin
        self.slabs: dict[int, list] = {}  # serial -> [path | None, uint8 tensor, pinned?]
        self.cur: int | None = None  # the slab being filled
        self.used = 0
        self._n = 0
        self.peak_need = 0  # the largest batch (bytes) prepare() was asked for
        self._in_use: deque = deque(maxlen=4096)  # (monotonic time, slabs in use) of recent batches
        self.keep_s = arena_keep_s()
        # slabs the caller will hold at once (a pipeline: its write queue plus the batch being
        # filled), made together instead of one each time its writers fall a batch further behind
        # (on the H200 each cost the engine ~0.35 s, measured); 0: made as needed
        self.want = 0
        self.t_new = 0.0  # seconds spent making slabs (allocating, mapping, page-locking)

    @property
    def capacity(self) -> int:
        return self.slabs[self.cur][1].numel() if self.cur is not None else 0

    @property
    def total_bytes(self) -> int:
        return sum(s[1].numel() for s in self.slabs.values())

    def paths(self) -> list:
        return [s[0] for s in self.slabs.values() if s[0] is not None]

    def prepare(self, need: int, busy=(), want: int | None = None) -> None:
        """Start a batch of up to ``need`` bytes in a slab whose file is not in ``busy`` (paths the
        driver still lends out). Free slabs that fit are kept for later batches (a pipeline that
        holds a few batches in its write queue reuses them instead of page-locking new ones), up
        to the recent peak of slabs in use at once, at least ``SPARE``; the rest are released.
        ``want`` (kept until changed): have that many slabs in all, making the missing ones now."""
        if want is not None:
            self.want = max(0, int(want))
        busy = set(busy)
        free = [k for k, s in self.slabs.items() if s[0] not in busy]
        in_use = len(self.slabs) - len(free) + 1
        now = time.monotonic()
        # the slabs asked for count as in use: kept through the same windows once the ask ends (a
        # benchmark's plain generate() runs between its pipeline runs: measured on the H200, each
        # released one, ~0.11 s, which the next pipeline run made again, ~0.35 s)
        self._in_use.append((now, max(in_use, self.want)))
        while len(self._in_use) > self.RECENT and now - self._in_use[0][0] > self.keep_s:
            self._in_use.popleft()  # older than both windows
        peak = max(n for _, n in self._in_use)
        fits = sorted((k for k in free if self.slabs[k][1].numel() >= need), key=lambda k: self.slabs[k][1].numel())
        chosen = fits[0] if fits else None
        keep = set(fits[: 1 + max(self.SPARE, peak - in_use)])  # (peak counts the slabs asked for)
        for k in free:
            if k not in keep:
                self._release(self.slabs.pop(k))
        self.peak_need = max(self.peak_need, need)
        if chosen is None:
            chosen = self._new_with_headroom(need)
        self.cur, self.used = chosen, 0
        self._provision(need)

    def _provision(self, need: int) -> None:
        """Make slabs (with headroom) until there are ``want``; stop at the first that finds no
        room in /dev/shm (logged): the batches that need one later get the usual clear error."""
        while need and len(self.slabs) < self.want:
            try:
                self._new(self._roomy(need))
            except ArenaSpaceError as e:
                logger.info("speculators_compat: made %d of the %d hand-off slabs asked for ahead; "
                            "the rest are made when needed (%s)", len(self.slabs), self.want, e)
                self.want = len(self.slabs)
                return

    def _roomy(self, need: int) -> int:
        """A new slab's size: the largest batch seen (or this one) with headroom."""
        return int(max(need, self.peak_need) * self.HEADROOM)

    def _new_with_headroom(self, need: int) -> int:
        roomy = self._roomy(need)
        if roomy > need:
            try:
                return self._new(roomy)
            except ArenaSpaceError:
                logger.info("speculators_compat: no room for a %.0f MiB hand-off slab; making one of "
                            "exactly %.0f MiB", roomy / 2**20, need / 2**20)
        return self._new(need)

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more (a new slab now, outside any forward)."""
        if self.used + nbytes > self.capacity:
            self.cur, self.used = self._new(max(nbytes, 2 * self.capacity)), 0

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """(slab, byte offset) of a fresh ``nbytes`` block."""
        nbytes = -(-nbytes // SHM_ALIGN) * SHM_ALIGN
        if self.used + nbytes > self.capacity:
            # the new slab starts empty; earlier ones keep their rows (this batch refers to them)
            self.cur, self.used = self._new(max(nbytes, 2 * self.capacity)), 0
        off = self.used
        self.used += nbytes
        return self.cur, off

    def view(self, idx: int, off: int, rows: int, hidden: int, dtype) -> torch.Tensor:
        es = dtype.itemsize
        return self.slabs[idx][1][off: off + rows * hidden * es].view(dtype).view(rows, hidden)

    def path(self, idx: int):
        return self.slabs[idx][0]

    def pinned(self, idx: int) -> bool:
        return self.slabs[idx][2]

    def _new(self, need: int) -> int:
        t0 = time.perf_counter()
        try:
            return self._make(need)
        finally:
            self.t_new += time.perf_counter() - t0

    def _make(self, need: int) -> int:
        size = max(need, 1 << 20)
        size = -(-size // 4096) * 4096
        self._n += 1
        path = None
        if self.prefix is None:
            t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            buf = [None, t, self.pin]
        else:
            path = f"{self.prefix}arena{self._n}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                lent = sum(1 for s in self.slabs.values() if s[0] is not None)
                raise ArenaSpaceError(
                    f"speculators_compat: cannot reserve {size / 2**20:.0f} MiB in {os.path.dirname(path)} "
                    f"for captured hidden states ({e.strerror}; {lent} slab(s) of "
                    f"{self.total_bytes / 2**20:.0f} MiB already there, incl. states of earlier batches "
                    "still referenced by the caller). Give it more room (docker: --shm-size or --ipc=host), "
                    "lower the batch, drop or .clone() results you keep, or set "
                    "SPECULATORS_COMPAT_HANDOFF=rpc") from e
            os.close(fd)
            t = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            buf = [path, t, False]
            if self.pin:
                buf[2] = _host_register(t)
        self.slabs[self._n] = buf
        return self._n

    def _release(self, buf) -> None:
        path, t, pinned = buf
        if pinned and path is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        buf[1] = None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for buf in self.slabs.values():
            self._release(buf)
        self.slabs = {}
        self.cur, self.used = None, 0


def _host_register(t: torch.Tensor) -> bool:
    """Page-lock a mapped hand-off file for the GPU (async DMA into it). False: copies stay synchronous."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    code = getattr(rc, "value", rc)
    if code != 0:
        logger.warning("speculators_compat: cudaHostRegister of the hand-off arena failed (%s); "
                       "device->host copies of captured states will be synchronous", rc)
        return False
    return True


@dataclass
class _Segment:
    start: int
    layers: list  # per captured layer (in layer_ids order): (buffer index, byte offset, rows)


@dataclass
class _CaptureState:
    layer_ids: list[int]
    handles: list = field(default_factory=list)
    expected: dict = field(default_factory=dict)  # req_id -> prompt length
    order: dict = field(default_factory=dict)  # req_id -> announcement serial (the arena's order)
    serial: int = 0
    segments: dict = field(default_factory=dict)  # req_id -> list[_Segment]
    scheduler_output: Any = None
    runner_kind: str = "v1"  # "v1": runner.input_batch; "v2": the step's batch from prepare_inputs
    step_batch: Any = None  # Model Runner V2: the InputBatch prepare_inputs built for this step
    layout: Any = None  # (req_ids, counts, starts) of the current forward (positions checked)
    plan: Any = None  # this forward's kept rows: (source rows: slice | index tensor, [(rid, start, n, row)])
    rows: dict = field(default_factory=dict)  # layer id -> (buffer, offset) or tensor (record_all)
    record_order: Any = None  # record_all under V2: step rows -> scheduler order (index), None: as run
    copy_mode: str = "pinned"
    arena: Any = None
    hidden: int = 0
    dtype: Any = None
    pending_event: Any = None
    copy_stream: Any = None  # GPU: side stream for device->host copies into the pinned arena
    record_all: bool = False
    all_rows: list = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    t_hooks: float = 0.0  # seconds inside capture hooks (device->host copies issued/done)
    t_take: float = 0.0  # seconds assembling and handing off in take()
    t_expect: float = 0.0  # seconds in compat_capture_expect (readying the arena for a batch)
    nonfinite: list = field(default_factory=list)  # device flags: did a step's layer hold NaN/Inf?
    regions: dict = field(default_factory=dict)  # req_id -> {layer id: (buffer, byte offset)} of its prompt
    region_row_bytes: int = 0  # the row size those regions were sized with


def install_capture(worker, layer_ids: list[int], record_all: bool = False, copy_mode: str | None = None,
                    handoff_prefix: str | None = None) -> dict:
    """Install forward hooks for ``layer_ids`` (absolute decoder-layer indices) on ``worker``.

    ``record_all`` keeps every forward's rows in step order (upstream's worker contract) instead
    of per announced request. ``handoff_prefix``: path prefix of the /dev/shm arena files (None:
    rows travel back pickled).
    """
    old = getattr(worker, "_compat_capture", None)
    if old is not None:
        for h in old.handles:
            h.remove()
        if old.arena is not None:
            old.arena.close()
        worker._compat_capture = None
    runner = worker.model_runner
    model = runner.model
    base = find_base_model(model)
    n = len(base.layers)
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer ids {bad} out of range: the model has {n} decoder layers (0..{n - 1})")
    info = {"num_layers": n, "base_model": type(base).__name__, "model": type(model).__name__,
            "capturing": False, "runner": type(runner).__name__}
    local = _moe_local_experts(model)
    if local is not None:  # on this rank: all experts under plain TP, a share under expert parallelism
        info["moe_local_experts"] = local
    kind = runner_kind(runner)
    info["runner_kind"] = kind
    if not _is_capture_rank():
        return info
    mode = copy_mode or os.environ.get(COPY_MODE_ENV, "pinned")
    if mode not in ("pinned", "sync"):
        raise ValueError(f"{COPY_MODE_ENV} must be 'pinned' or 'sync', not {mode!r}")
    st = _CaptureState(layer_ids=list(layer_ids), copy_mode=mode, record_all=record_all, runner_kind=kind)
    mc = getattr(runner, "model_config", None)
    if mc is not None:
        st.hidden, st.dtype = int(mc.get_hidden_size()), mc.dtype
    on_gpu = next(model.parameters()).device.type == "cuda"
    st.arena = _Arena(handoff_prefix, pin=on_gpu and mode == "pinned")
    worker._compat_capture = st
    _wrap_runner(runner, st)
    # vLLM's @support_torch_compile replaces the decoder stack's __call__, so hooks on the stack
    # itself never fire; its layers are plain modules. The first layer's pre-hook reads the step
    # layout; once the last captured layer ran, the rows are split by request.
    first = getattr(base, "start_layer", 0)
    st.handles.append(base.layers[first].register_forward_pre_hook(_make_pre_forward(runner, st),
                                                                   with_kwargs=True))
    distribute = _make_distribute(st)
    for lid in sorted(set(layer_ids)):
        st.handles.append(base.layers[lid].register_forward_hook(_make_layer_hook(st, lid, distribute)))
    info["capturing"] = True
    info["handoff"] = "shm" if handoff_prefix else "rpc"
    return info


def _moe_local_experts(model) -> int | None:
    """Routed experts held on this rank by the first fused-MoE layer, read from its expert weights
    (``w13_weight``, or ``w13_weight_packed`` when quantized: dim 0 is the local expert count in
    the 0.11, 0.12, 0.16, 0.17 and 0.32 sources); None for a dense model."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("w13_weight") and p.dim() >= 2:
            return int(p.shape[0])
    return None


def runner_kind(runner) -> str:
    """Where a runner keeps the order of requests in a step: ``"v1"`` (the V1 runner's persistent
    ``input_batch``, vLLM 0.11-0.33) or ``"v2"`` (Model Runner V2, opt-in before 0.34 and the only
    runner from 0.34: ``prepare_inputs`` builds a fresh ``InputBatch`` for each step)."""
    if hasattr(runner, "input_batch"):
        return "v1"
    if callable(getattr(runner, "prepare_inputs", None)):
        return "v2"
    raise RuntimeError(
        f"speculators_compat: the model runner {type(runner).__name__} has neither an `input_batch` "
        "(vLLM's V1 runner) nor a `prepare_inputs` method (Model Runner V2): capture cannot tell which "
        "rows of a step belong to which request. This vLLM is not supported.")


def _wrap_runner(runner, st: _CaptureState) -> None:
    # Record the SchedulerOutput of each step: it tells how many tokens each request has in it.
    # Model Runner V2 also: the step's InputBatch (the order of its requests).
    runner._compat_state = st
    if getattr(runner, "_compat_wrapped", False):
        return
    orig = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        cur = runner._compat_state
        # a V2 dummy run (profiling, warm-up) takes a made-up SchedulerOutput: nothing to capture
        cur.scheduler_output = None if kwargs.get("dummy_run") else scheduler_output
        cur.step_batch = None
        try:
            return orig(scheduler_output, *args, **kwargs)
        finally:
            cur.scheduler_output = None
            cur.step_batch = None

    execute_model.__wrapped__ = orig  # type: ignore[attr-defined]
    runner.execute_model = execute_model
    if st.runner_kind == "v2":
        orig_prepare = runner.prepare_inputs

        def prepare_inputs(*args, **kwargs):
            batch = orig_prepare(*args, **kwargs)
            runner._compat_state.step_batch = batch
            return batch

        prepare_inputs.__wrapped__ = orig_prepare  # type: ignore[attr-defined]
        runner.prepare_inputs = prepare_inputs
    runner._compat_wrapped = True


def _step_requests(runner, st: _CaptureState, so) -> tuple[list, list, Any] | None:
    """(request ids in the order of the step's flattened tokens, tokens each, a fallback for
    their start positions) or None when the forward is not a scheduled step."""
    if st.runner_kind == "v2":
        b = st.step_batch
        if b is None:
            return None  # a forward outside prepare_inputs: dummy / profiling run
        n = int(b.num_reqs)
        req_ids = list(b.req_ids[:n])
        counts = [int(so.num_scheduled_tokens.get(r, 0)) for r in req_ids]
        own = [int(x) for x in b.num_scheduled_tokens[:n]]
        if own != counts:
            raise RuntimeError(
                "speculators_compat: the step's input batch and the scheduler disagree on how many "
                f"tokens each request has ({dict(zip(req_ids, own))} vs {dict(zip(req_ids, counts))}); "
                "rows cannot be attributed safely")
        computed = getattr(b, "num_computed_tokens_np", None)
        return req_ids, counts, (lambda i: int(computed[i])) if computed is not None else None
    ib = runner.input_batch
    req_ids = list(ib.req_ids[: ib.num_reqs]) if hasattr(ib, "num_reqs") else list(ib.req_ids)
    counts = [int(so.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    return req_ids, counts, lambda i: int(ib.num_computed_tokens_cpu[i])


def _make_pre_forward(runner, st: _CaptureState):
    def pre_forward(module, args, kwargs):
        st.layout = None
        st.plan = None
        st.rows = {}
        so = st.scheduler_output
        if so is None or not (st.expected or st.record_all):
            return None  # warm-up / profiling / dummy run, or nothing to capture
        step = _step_requests(runner, st, so)
        if step is None:
            return None
        req_ids, counts, computed = step
        positions = kwargs.get("positions")  # decoder layers: forward(positions, hidden_states, ...)
        if positions is None and args:
            positions = args[0]
        total = sum(counts)
        if isinstance(positions, torch.Tensor) and positions.dim() == 1 and total:
            # one device->host copy per step; every check below runs on the host
            pos = positions[:total].to("cpu", non_blocking=False).long()
            cnt = torch.tensor(counts, dtype=torch.long)
            offsets = torch.cumsum(cnt, 0) - cnt
            starts_t = pos[offsets.clamp(max=total - 1)]
            expected = torch.repeat_interleave(starts_t, cnt) + torch.arange(total) - torch.repeat_interleave(offsets, cnt)
            if not torch.equal(pos, expected):
                bad_row = int((pos != expected).nonzero()[0])
                owner = int(torch.searchsorted(torch.cumsum(cnt, 0), bad_row, right=True))
                raise RuntimeError(
                    f"speculators_compat: request {req_ids[owner]}: positions of its rows are not "
                    "contiguous (attribution would be wrong)")
            starts = starts_t.tolist()
        else:  # M-RoPE style positions: fall back to the runner's computed-token counts
            if computed is None:
                raise RuntimeError("speculators_compat: the step has no 1-D positions and the runner's "
                                   "input batch no computed-token counts: rows cannot be placed")
            starts = [computed(i) for i in range(len(req_ids))]
        st.layout = (req_ids, counts, starts)
        device = positions.device if isinstance(positions, torch.Tensor) else None
        if st.record_all:
            st.record_order = _scheduler_order(req_ids, counts, so, device) if st.runner_kind == "v2" else None
        else:
            st.plan = _plan_rows(st, req_ids, counts, starts, device)
        return None

    return pre_forward


def _scheduler_order(req_ids, counts, so, device):
    """Upstream's record-everything contract hands back a step's rows in the order its requests
    were scheduled (the V1 runner runs them in that order; upstream's generator slices by it).
    Model Runner V2 runs them sorted by token count: an index that puts the rows back in the
    scheduler's order, or None when they already are."""
    where, offset = {}, 0
    for rid, n in zip(req_ids, counts):
        where[rid] = (offset, n)
        offset += n
    wanted = [r for r in so.num_scheduled_tokens if r in where]
    if wanted == list(req_ids):
        return None
    idx = torch.cat([torch.arange(where[r][0], where[r][0] + where[r][1]) for r in wanted])
    return idx.to(device) if device is not None else idx


def _plan_rows(st: _CaptureState, req_ids, counts, starts, device, arena_order: bool | None = None):
    """Which rows of this forward to keep: prompt rows of announced requests, nothing else.

    Returns (source, kept) where ``source`` selects the kept rows from the layer output (a slice
    when they are one contiguous run, else an index tensor) and ``kept`` lists (request, start
    position, rows, first row in the compacted block).

    ``arena_order`` (default: on a GPU) takes the kept rows in announcement order, the order of
    the requests' regions in the arena: Model Runner V2 orders a step's requests by token count,
    and rows taken in step order would then need one device->host copy per request instead of one
    per layer. (On a CPU the rows are added into the arena run by run, no gather first.)
    """
    entries, offset = [], 0  # (request, start, rows, offset in the step)
    for rid, n, start in zip(req_ids, counts, starts):
        plen = st.expected.get(rid)
        if n and plen is not None and start < plen:
            entries.append((rid, start, min(n, plen - start), offset))
        offset += n
    if not entries:
        return None
    if arena_order is None:
        arena_order = device is not None and device.type == "cuda"
    if arena_order:
        entries.sort(key=lambda e: st.order.get(e[0], -1))  # stable: V1 steps keep their order
    kept, ranges, row = [], [], 0
    for rid, start, keep, off in entries:
        kept.append((rid, start, keep, row))
        ranges.append((off, off + keep))
        row += keep
    if all(a == b for (_, a), (b, _) in zip(ranges, ranges[1:])):
        source = slice(ranges[0][0], ranges[-1][1])
    else:
        idx = torch.cat([torch.arange(a, b) for a, b in ranges])
        source = idx.to(device) if device is not None else idx
    return source, kept


def _make_distribute(st: _CaptureState):
    def distribute():
        st.steps += 1
        if st.record_all:
            st.all_rows.append([st.rows[lid] for lid in sorted(set(st.layer_ids))])
        elif st.plan is not None:
            _, kept = st.plan
            for i, (rid, start, n, _row) in enumerate(kept):
                layers = [(*st.rows[lid][i], n) for lid in st.layer_ids]  # where _store_rows put them
                st.segments.setdefault(rid, []).append(_Segment(start, layers))
                st.tokens += n
        st.rows = {}
        st.layout = None
        st.plan = None

    return distribute


def take_captures(worker, req_ids: list[str], want_data: bool = True) -> dict:
    """Captures for ``req_ids``: {"states": {rid: [per layer]}, "errors": {rid: msg}, "arena": ...}.

    With a /dev/shm arena each layer is a list of (file, byte offset, rows) blocks in position
    order, for the driver to copy out; otherwise each layer is a tensor (pickled over the RPC).
    Forgets the requests afterwards (``want_data=False``: only that). Only the capturing rank
    returns data.
    """
    st = getattr(worker, "_compat_capture", None)
    if st is None:
        return {"states": {}, "errors": {}, "rank_captures": False}
    t0 = time.perf_counter()
    try:
        return _take(st, req_ids, want_data)
    finally:
        st.t_take += time.perf_counter() - t0


def _take(st, req_ids, want_data):
    _sync(st)
    flagged = bool(torch.stack(st.nonfinite).any()) if st.nonfinite else False
    st.nonfinite = []
    arena = st.arena
    states, errors = {}, {}
    for rid in req_ids:
        plen = st.expected.pop(rid, None)
        st.order.pop(rid, None)
        st.regions.pop(rid, None)
        segs = sorted(st.segments.pop(rid, []), key=lambda s: s.start)
        if not want_data:
            continue
        if plen is None:
            errors[rid] = "request was never announced to the worker"
            continue
        pos, problem = 0, None
        for s in segs:
            n = s.layers[0][2]
            if s.start != pos:
                problem = (f"positions {pos}..{s.start - 1} missing" if s.start > pos
                           else f"positions {s.start}..{min(pos, s.start + n) - 1} captured twice")
                break
            pos += n
        if problem is None and pos != plen:
            problem = f"captured {pos} of {plen} prompt positions"
        if problem is not None:
            errors[rid] = problem + " (prefix-cache hit, aborted request or lost step?)"
            continue
        if flagged:  # slow path, only when some row somewhere was not finite
            bad = [st.layer_ids[j] for j in range(len(st.layer_ids))
                   if not all(bool(torch.isfinite(arena.view(b, o, n, st.hidden, st.dtype)).all())
                              for b, o, n in (s.layers[j] for s in segs))]
            if bad:
                errors[rid] = f"NaN/Inf hidden states in layer(s) {bad}"
                continue
        row_bytes = st.hidden * st.dtype.itemsize
        blocks = [_merge_adjacent([s.layers[j] for s in segs], row_bytes) for j in range(len(st.layer_ids))]
        if arena.prefix is not None:
            states[rid] = [[(arena.path(b), o, n) for b, o, n in layer] for layer in blocks]
        else:
            states[rid] = [_gather(arena, layer, st.hidden, st.dtype) for layer in blocks]
    return {"states": states, "errors": errors, "rank_captures": True, "slabs": arena.paths(),
            "hidden": st.hidden, "dtype": str(st.dtype).replace("torch.", "")}


def _merge_adjacent(blocks: list, row_bytes: int) -> list:
    """(buffer, offset, rows) blocks in position order, each run of blocks that lie back to back
    in one buffer merged into one block (the same bytes, in the same order)."""
    out = []
    for b, o, n in blocks:
        if out and out[-1][0] == b and out[-1][1] + out[-1][2] * row_bytes == o:
            out[-1] = (b, out[-1][1], out[-1][2] + n)
        else:
            out.append((b, o, n))
    return out


def _gather(arena, blocks, hidden, dtype) -> torch.Tensor:
    views = [arena.view(b, o, n, hidden, dtype) for b, o, n in blocks]
    return views[0].clone() if len(views) == 1 else torch.cat(views, dim=0)


def take_all_rows(worker):
    """Upstream's contract: one tensor per (sorted) layer, all rows since the last reset, step order."""
    st = getattr(worker, "_compat_capture", None)
    if st is None or not st.all_rows:
        return None
    _sync(st)
    out = [torch.cat([step[j] for step in st.all_rows], dim=0) for j in range(len(st.all_rows[0]))]
    st.all_rows = []
    st.nonfinite = []  # upstream's contract has no NaN check; don't let the flags pile up
    return out


def _sync(st: _CaptureState) -> None:
    if st.pending_event is not None:
        st.pending_event.synchronize()
        st.pending_event = None


class CaptureExtension:
    """Mixed into vLLM's Worker. Public surface: the ``compat_*`` methods (called via RPC)."""

    def compat_ping(self) -> str:
        return "speculators_compat"

    def compat_capture_setup(self, layer_ids: list[int], copy_mode: str | None = None,
                             handoff_prefix: str | None = None) -> dict:
        return install_capture(self, layer_ids, copy_mode=copy_mode, handoff_prefix=handoff_prefix)

    def compat_capture_expect(self, expected: dict, busy=(), slabs: int | None = None) -> None:
        """Announce request ids and their prompt lengths before they are scheduled; size the arena.
        ``busy``: arena files the driver still lends out (tensors its caller holds): never refilled.
        ``slabs``: how many batches' rows the caller will hold at once (None: as before)."""
        st = getattr(self, "_compat_capture", None)
        if st is None:
            return
        t0 = time.perf_counter()
        need = 0
        if st.hidden and st.dtype is not None:
            es = st.dtype.itemsize
            rows = sum(expected.values())
            # kept rows + per-block alignment for up to one block per (request, layer, step)
            need = len(st.layer_ids) * (rows * st.hidden * es + SHM_ALIGN * (len(expected) + 8))
        # before accepting the batch: a failure (no room) leaves no trace
        if not st.segments and not st.regions:  # every earlier batch was taken: a new one in a free slab
            st.arena.prepare(need, busy, slabs)
        else:
            st.arena.reserve(need)
        if need and not st.record_all:
            # each request's rows per layer: one region in announcement order, layer by layer, so
            # requests that run in that order are adjacent (rows of 64-byte multiples: no padding)
            st.region_row_bytes = row_bytes = st.hidden * st.dtype.itemsize
            for lid in sorted(set(st.layer_ids)):
                for rid, plen in expected.items():
                    if rid not in st.expected and plen > 0:
                        st.regions.setdefault(rid, {})[lid] = st.arena.alloc(plen * row_bytes)
        for rid in expected:
            if rid not in st.order:
                st.order[rid] = st.serial
                st.serial += 1
        st.expected.update(expected)
        st.t_expect += time.perf_counter() - t0

    def compat_capture_take(self, req_ids: list[str], want_data: bool = True) -> dict:
        return take_captures(self, req_ids, want_data)

    def compat_capture_reset(self) -> None:
        st = getattr(self, "_compat_capture", None)
        if st is not None:
            st.expected.clear()
            st.order.clear()
            st.segments.clear()
            st.regions.clear()
            st.all_rows = []

    def compat_capture_stats(self) -> dict:
        st = getattr(self, "_compat_capture", None)
        if st is None:
            return {}
        return {"steps": st.steps, "tokens": st.tokens, "pending_requests": len(st.segments),
                "copy_mode": st.copy_mode, "hook_s": round(st.t_hooks, 3),
                "take_s": round(st.t_take, 3), "worker_expect_s": round(st.t_expect, 4), "arena_bytes": st.arena.total_bytes if st.arena else 0,
                "arena_slabs": len(st.arena.slabs) if st.arena else 0,
                "arena_slabs_made": st.arena._n if st.arena else 0,
                "arena_new_s": round(st.arena.t_new, 4) if st.arena else 0.0,
                "arena_want": st.arena.want if st.arena else 0}  # (each one allocated, page-locked on a GPU)


def _make_layer_hook(st: _CaptureState, lid: int, distribute):
    n_layers = len(set(st.layer_ids))

    def hook(module, args, output):
        if st.layout is None:
            return None
        t0 = time.perf_counter()
        if st.record_all:
            st.rows[lid] = _record_rows(st, output)
        elif st.plan is not None:
            st.rows[lid] = _store_rows(st, output, lid)
        if len(st.rows) == n_layers or (st.plan is None and not st.record_all):  # step done, or nothing to keep
            distribute()
        st.t_hooks += time.perf_counter() - t0
        return None

    return hook


def _store_rows(st: _CaptureState, output: Any, lid: int) -> list[tuple[int, int]]:
    """Write this forward's kept rows of layer ``lid`` into the arena; returns (buffer, byte
    offset) for each kept entry of the plan, in its order.

    Rows go to their requests' regions (one copy per run of entries adjacent both in the step and
    in the arena); a step with an entry that has none (its rows' size differs from the one the
    regions were sized with, or no region was made) goes into one fresh block, as one copy."""
    source, kept = st.plan
    rows = kept[-1][3] + kept[-1][2]
    if isinstance(output, tuple):
        hidden, residual = output[0], (output[1] if len(output) > 1 else None)
        if not isinstance(residual, torch.Tensor):
            residual = None
    else:
        hidden, residual = output, None
    pick = (lambda t: t[source]) if isinstance(source, slice) else (lambda t: t.index_select(0, source))
    h = pick(hidden.detach())
    if st.dtype is None or h.shape[-1] != st.hidden or h.dtype != st.dtype:  # first capture defines them
        st.hidden, st.dtype = int(h.shape[-1]), h.dtype
    row_bytes = st.hidden * h.element_size()
    places = [st.regions.get(rid, {}).get(lid) for rid, _, _, _ in kept]
    if row_bytes == st.region_row_bytes and all(p is not None for p in places):
        dests = [(b, off + start * row_bytes) for (b, off), (_, start, _, _) in zip(places, kept)]
    else:
        b, off = st.arena.alloc(rows * row_bytes)
        dests = [(b, off + row * row_bytes) for _, _, _, row in kept]
    runs = []  # [buffer, byte offset, first source row, rows]: entries contiguous in both
    for (b, off), (_, _, n, row) in zip(dests, kept):
        last = runs[-1] if runs else None
        if last and last[0] == b and last[1] + last[3] * row_bytes == off and last[2] + last[3] == row:
            last[3] += n
        else:
            runs.append([b, off, row, n])
    if h.device.type == "cpu":
        # one pass: the residual stream (hidden + residual) lands in the arena directly
        res = pick(residual.detach()) if residual is not None else None
        for b, off, row, n in runs:
            dst = st.arena.view(b, off, n, st.hidden, st.dtype)
            if res is not None:
                torch.add(h[row:row + n], res[row:row + n], out=dst)
            else:
                dst.copy_(h[row:row + n])
            st.nonfinite.append(_nonfinite_flag(dst))
    else:
        if residual is not None:
            val = h + pick(residual.detach())
        elif isinstance(source, slice):  # a view of the layer output, which later layers may
            val = h.clone()              # update in place while the copy below is in flight
        else:
            val = h  # index_select made it
        # NaN/Inf check where the data is hot: one reduction on the device, read once at take()
        st.nonfinite.append(_nonfinite_flag(val))
        for b, off, row, n in runs:
            dst = st.arena.view(b, off, n, st.hidden, st.dtype)
            if st.arena.pinned(b):  # pinned (page-locked) arena: an asynchronous DMA
                _copy_on_side_stream(st, dst, val[row:row + n])
            else:
                dst.copy_(val[row:row + n])
    return dests


def _copy_on_side_stream(st: _CaptureState, dst: torch.Tensor, val: torch.Tensor) -> None:
    """Device->host DMA of ``val`` on a side stream, so the forward's next kernels do not queue
    behind it (on the compute stream a 1B model's four captured layers cost ~10 ms of a 105 ms
    batch on an H200). The side stream waits for ``val`` to be computed; ``record_stream`` keeps
    its memory from being reused until the copy is done; take() waits for the last copy."""
    main = torch.cuda.current_stream(val.device)
    if st.copy_stream is None:
        st.copy_stream = torch.cuda.Stream(device=val.device)
    side = st.copy_stream
    side.wait_stream(main)
    with torch.cuda.stream(side):
        dst.copy_(val, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
    val.record_stream(side)
    st.pending_event = ev


def _nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: might ``t`` hold NaN/Inf? One float32 sum, no boolean mask: any NaN or Inf makes
    the sum non-finite, so nothing is missed; a finite sum that overflows (|values| ~1e38) only sends
    take() down its exact per-request check."""
    return ~torch.isfinite(t.sum(dtype=torch.float32))


def _record_rows(st: _CaptureState, output: Any) -> torch.Tensor:
    """All rows of this forward as a host tensor of its own (upstream's record-everything contract)."""
    total = sum(st.layout[1])
    out = _layer_output(output)[:total].detach()
    if st.record_order is not None:
        out = out.index_select(0, st.record_order)  # a new tensor, in the scheduler's order
    st.nonfinite.append(~torch.isfinite(out).all())
    if out.device.type == "cpu":
        # hidden + residual is a fresh tensor; a bare layer output may be updated in place later
        return out.clone() if out.data_ptr() == _first_ptr(output) else out
    if st.copy_mode == "pinned":
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        st.pending_event = ev
        return host
    return out.cpu()


def _first_ptr(output: Any) -> int:
    t = output[0] if isinstance(output, tuple) else output
    return t.data_ptr() if isinstance(t, torch.Tensor) else -1


def _is_capture_rank() -> bool:
    try:
        from vllm.distributed import get_pp_group, get_tp_group
    except ImportError:  # pragma: no cover - only outside vLLM
        return True
    return get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank

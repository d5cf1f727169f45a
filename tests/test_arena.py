"""The worker's hand-off arena and row plan (engine/arena.py, attribution.py, handoff.py), without an engine.

The real-engine tests (tests/engine) run the same code inside vLLM workers; these pin down the
edge cases an engine run rarely reaches: growth in the middle of a batch, a full /dev/shm, rows of
requests that are not ours in the middle of a step.
"""

import errno
import glob
import os

import pytest

torch = pytest.importorskip("torch")

from speculators_compat.engine import arena as arena_mod  # noqa: E402
from speculators_compat.engine import attribution, capture, handoff  # noqa: E402
from speculators_compat.engine import rows as rows_mod  # noqa: E402
from speculators_compat.errors import ArenaSpaceError  # noqa: E402


@pytest.fixture
def prefix(tmp_path):
    return str(tmp_path / "sc-test-")


def test_growth_keeps_earlier_blocks_until_the_next_batch(prefix):
    a = arena_mod.Arena(prefix, pin=False)
    a.reserve(1 << 20)
    b0, o0 = a.alloc(512 * 1024)
    a.view(b0, o0, 1024, 128, torch.float32).fill_(1.5)
    b1, o1 = a.alloc(3 << 20)  # does not fit: a second, larger buffer
    assert b1 == b0 + 1 and o1 == 0
    a.view(b1, o1, 2048, 128, torch.float32).fill_(-2.0)
    assert a.view(b0, o0, 1024, 128, torch.float32).eq(1.5).all()  # the first block is intact
    assert len(glob.glob(prefix + "*")) == 2
    a.prepare(3 << 20)  # the next batch (nothing lent): the slab that fits is reused, the small one goes
    assert a.cur == b1 and a.used == 0 and len(glob.glob(prefix + "*")) == 1
    a.close()
    assert glob.glob(prefix + "*") == []


def test_with_requests_in_flight_a_slab_none_of_them_uses_is_filled_again(prefix):
    """Continuous batching (the capture connector under vLLM's server) never drains the arena: ``reserve`` with the slabs
    the requests in flight use takes a free slab that fits instead of making ever larger ones,
    and releases free ones beyond SPARE."""
    a = arena_mod.Arena(prefix, pin=False)
    a.prepare(1 << 20)
    first = a.cur
    a.alloc(1 << 20)  # full
    a.reserve(1 << 20, live={first})  # the first still in use: a new slab, no larger than asked
    second = a.cur
    assert second != first and a.capacity < 2 << 20
    a.alloc(1 << 20)
    a.reserve(1 << 20, live={second})  # the first is free again: filled again, nothing made
    assert a.cur == first and a.used == 0 and len(a.slabs) == 2
    for _ in range(6):  # a long stream of reserves: the arena stays at what is in flight
        a.alloc(1 << 20)
        a.reserve(1 << 20, live={a.cur})
    assert len(a.slabs) <= 2 + a.SPARE and a.total_bytes < 6 << 20
    a.reserve(3 << 20, live={a.cur})  # none fits: a new one, and free ones beyond SPARE go
    assert a.capacity >= 3 << 20
    a.close()


def test_blocks_are_aligned(prefix):
    a = arena_mod.Arena(prefix, pin=False)
    offs = [a.alloc(n)[1] for n in (3, 100, 2, 64, 1)]
    assert all(o % arena_mod.SHM_ALIGN == 0 for o in offs)
    a.close()


def test_full_shm_is_a_clear_error_and_leaves_nothing(prefix, monkeypatch):
    # A full /dev/shm cannot be produced without privileges here: this seam stands in for
    # posix_fallocate's ENOSPC (what a docker container's 64 MiB /dev/shm gives).
    def full(fd, off, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    a = arena_mod.Arena(prefix, pin=False)
    with pytest.raises(ArenaSpaceError, match=r"shm-size.*SPECULATORS_COMPAT_HANDOFF=rpc"):
        a.reserve(10 << 20)
    assert glob.glob(prefix + "*") == []


def test_memory_arena_for_rpc_handoff():
    a = arena_mod.Arena(None, pin=False)
    b, o = a.alloc(4096)
    assert a.path(b) is None
    a.view(b, o, 4, 256, torch.float32).fill_(3.0)
    assert capture._gather(a, [(b, o, 4)], 256, torch.float32).eq(3.0).all()
    a.close()


def _state(expected, hidden=8):
    st = capture._CaptureState(layer_ids=[0])
    st.expected, st.hidden, st.dtype = dict(expected), hidden, torch.float32
    return st


def test_plan_contiguous_rows_use_a_slice():
    st = _state({"a": 10, "b": 4})
    source, kept = attribution.plan_rows(st, ["a", "b"], [6, 4], [0, 0], None)
    assert source == slice(0, 10)
    assert kept == [("a", 0, 6, 0), ("b", 0, 4, 6)]


def test_plan_skips_foreign_and_decode_rows():
    # "x" is not ours; "b" is past its prompt (a decode row): neither is kept, and the rows of
    # "c" behind them are picked by index, not by offset
    st = _state({"a": 10, "b": 3, "c": 5})
    source, kept = attribution.plan_rows(st, ["a", "x", "b", "c"], [4, 2, 1, 5], [6, 0, 3, 0], None)
    assert kept == [("a", 6, 4, 0), ("c", 0, 5, 4)]
    assert source.tolist() == [0, 1, 2, 3, 7, 8, 9, 10, 11]


def test_plan_in_arena_order_undoes_a_step_sorted_by_length():
    # Model Runner V2 sorts a step's requests by token count: announced a, b, c (10, 3, 6 tokens)
    # run as b, c, a. In arena order the kept rows come back as a, b, c: one run per layer where
    # the regions are adjacent; in step order they stay as scheduled.
    st = _state({"a": 10, "b": 3, "c": 6})
    st.order = {"a": 0, "b": 1, "c": 2}
    source, kept = attribution.plan_rows(st, ["b", "c", "a"], [3, 6, 10], [0, 0, 0], None, arena_order=True)
    assert kept == [("a", 0, 10, 0), ("b", 0, 3, 10), ("c", 0, 6, 13)]
    assert source.tolist() == list(range(9, 19)) + [0, 1, 2] + list(range(3, 9))
    rows = torch.arange(19.0)  # row r of the step holds the value r
    assert rows[source].tolist() == list(range(9, 19)) + [0, 1, 2] + list(range(3, 9))
    source, kept = attribution.plan_rows(st, ["b", "c", "a"], [3, 6, 10], [0, 0, 0], None, arena_order=False)
    assert [k[0] for k in kept] == ["b", "c", "a"] and source == slice(0, 19)


def test_plan_trims_rows_past_the_prompt():
    st = _state({"a": 5})
    source, kept = attribution.plan_rows(st, ["a"], [4], [3], None)
    assert kept == [("a", 3, 2, 0)] and source == slice(0, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_flag_catches_every_bad_value(bad):
    t = torch.randn(64, 32).bfloat16()
    assert not bool(rows_mod._nonfinite_flag(t))
    t[17, 5] = bad
    assert bool(rows_mod._nonfinite_flag(t))


def test_driver_never_poisons_fork_before_the_engine_starts(monkeypatch):
    """torch.cuda.is_available() calls cudaGetDeviceCount, which poisons fork: vLLM then forks its
    GPU workers (CUDA not initialised) and they die at start-up (seen on an H200 with the extract
    CLI). This CPU machine has no CUDA, so the seam is replaced: any call to is_available fails."""
    from speculators_compat import generator

    def poisoned():
        raise AssertionError("torch.cuda.is_available() called in the driver")

    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    generator._check_devices(1)
    assert handoff.ArenaReader().mode in ("pinned", "malloc")
    from speculators_compat.pipeline import plan

    plan._detect_gpu_gib()


def test_threaded_copy_out_equals_single_thread_and_owns_storage(prefix):
    """The driver's copy-out with a thread pool must give exactly the single-thread result, each
    tensor owning exactly its rows, for requests whose layers span several blocks and files."""

    hidden, dtype = 1024, torch.bfloat16
    a = arena_mod.Arena(prefix, pin=False)
    a.reserve(4096)
    states = {}
    g = torch.Generator().manual_seed(3)
    for r in range(7):
        layers = []
        for _ in range(3):
            blocks = []
            for rows in (40 + 5 * r, 3):  # two blocks per layer (a chunked prompt); grows the arena
                b, off = a.alloc(rows * hidden * 2)
                a.view(b, off, rows, hidden, dtype).copy_(torch.randn(rows, hidden, generator=g))
                blocks.append((a.path(b), off, rows))
            layers.append(blocks)
        states[f"r{r}"] = layers
    assert len({p for ls in states.values() for bl in ls for p, _, _ in bl}) > 1, "expected growth"
    one = handoff.ArenaReader(threads=1).assemble_all(states, hidden, dtype)
    reader = handoff.ArenaReader(threads=3)
    many = reader.assemble_all(states, hidden, dtype)
    assert reader._pool is not None, "three threads must use the pool"
    assert list(many) == list(one)
    for r in one:
        for x, y in zip(one[r], many[r]):
            assert torch.equal(x, y)
            assert y.untyped_storage().nbytes() == y.numel() * y.element_size()
    reader.close()
    a.close()


def test_copy_threads_auto():
    from speculators_compat.engine import handoff

    assert handoff.ArenaReader().threads == 1  # CPU hosts: the engine needs the cores
    assert 1 <= handoff.auto_copy_threads("pinned") <= 8


@pytest.mark.parametrize("bad", ["yes", "2", "lend"])
def test_zero_copy_setting_is_checked(monkeypatch, bad):
    from speculators_compat import envs

    monkeypatch.setenv("SPECULATORS_COMPAT_ZERO_COPY", bad)
    with pytest.raises(ValueError, match="SPECULATORS_COMPAT_ZERO_COPY must be one of 1, 0"):
        envs.enabled("SPECULATORS_COMPAT_ZERO_COPY")


def test_prepare_never_refills_a_busy_slab_and_keeps_few_spares(prefix):
    a = arena_mod.Arena(prefix, pin=False)
    a.prepare(1 << 20)
    first = a.cur
    a.prepare(1 << 20, busy=[a.path(first)])  # the caller still holds rows of the first batch
    second = a.cur
    assert second != first and len(a.slabs) == 2
    a.prepare(1 << 20, busy=[a.path(first), a.path(second)])
    assert a.cur not in (first, second) and len(a.slabs) == 3
    for _ in range(3):  # everything returned: free slabs are reused, at most SPARE kept besides
        a.prepare(1 << 20)
        assert a.cur in (first, second, a._n)
    assert len(a.slabs) <= 1 + arena_mod.Arena.SPARE
    a.prepare(4 << 20)  # a bigger batch: slabs too small for it are released
    assert len(a.slabs) == 1 and a.capacity >= 4 << 20
    assert len(glob.glob(prefix + "*")) == 1
    a.close()
    assert glob.glob(prefix + "*") == []


def test_slab_serials_are_never_reused(prefix):
    a = arena_mod.Arena(prefix, pin=False)
    seen = set()
    for i in range(5):
        a.prepare((2 << i) << 20)  # each batch twice as big (past the headroom): the old slab is released
        assert a.cur not in seen and a.path(a.cur) not in {p for _, p in seen}
        seen.add((a.cur, a.path(a.cur)))
    a.close()


def _filled_arena(prefix, hidden, dtype, rows_per_block, seed=5):
    a = arena_mod.Arena(prefix, pin=False)
    a.prepare(1 << 20)
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for rows in rows_per_block:
        b, off = a.alloc(rows * hidden * dtype.itemsize)
        a.view(b, off, rows, hidden, dtype).copy_(torch.randn(rows, hidden, generator=g))
        blocks.append((a.path(b), off, rows))
    return a, blocks


def test_lent_tensor_is_exactly_its_block_and_busy_until_every_view_dies(prefix, tmp_path):
    import gc

    hidden, dtype = 256, torch.bfloat16
    a, blocks = _filled_arena(prefix, hidden, dtype, [7, 5])
    r = handoff.ArenaReader(threads=1, lend=True)
    lent = r.assemble([blocks[0]], hidden, dtype)
    joined = r.assemble(blocks, hidden, dtype)  # two blocks: copied
    p, off, rows = blocks[0]
    assert torch.equal(lent, a.view(a.cur, off, rows, hidden, dtype))
    assert lent.untyped_storage().nbytes() == rows * hidden * 2  # torch.save writes just these rows
    assert torch.equal(joined[:7], lent) and joined.untyped_storage().nbytes() == 12 * hidden * 2
    # same bytes on disk as a copy of its own (a resume across hand-off modes stays byte-identical)
    (tmp_path / "lent").mkdir()
    (tmp_path / "copy").mkdir()
    torch.save({"h": lent}, tmp_path / "lent" / "s.pt")  # (the archive inside is named after the file)
    torch.save({"h": lent.clone()}, tmp_path / "copy" / "s.pt")
    assert (tmp_path / "lent" / "s.pt").read_bytes() == (tmp_path / "copy" / "s.pt").read_bytes()
    assert r.busy() == [p]
    view = lent[2:4]
    del lent
    gc.collect()
    assert r.busy() == [p], "a view still lives in the slab"
    del view
    gc.collect()
    assert r.busy() == []
    r.close()
    a.close()


def test_rows_dropped_into_an_old_garbage_cycle_come_back(prefix):
    """A lent tensor the caller dropped while it sat in a reference cycle that had already been
    promoted to the oldest GC generation (torch.save makes such cycles; so can any code): the
    young-generation collection cannot free it, so busy() runs a full collection, spaced so it
    costs at most 1/FULL_GC_SPACING of the time."""
    import gc

    hidden, dtype = 32, torch.float32
    a, blocks = _filled_arena(prefix, hidden, dtype, [4])
    r = handoff.ArenaReader(threads=1, lend=True)
    holder = [r.assemble(blocks, hidden, dtype)]
    holder.append(holder)  # a cycle ...
    gc.collect(1)  # ... that survives into the oldest generation while still referenced
    gc.collect(1)
    del holder  # now garbage that only a full collection frees
    gc.disable()  # (no automatic collection may free it behind the test's back)
    try:
        before = r.full_collections
        assert r.busy() == []
        assert r.full_collections == before + 1
        held = r.assemble(blocks, hidden, dtype)  # really held: busy, and no second full collection
        r._next_full_gc = float("inf")  # as if one had just run
        assert r.busy() == [blocks[0][0]] and r.full_collections == before + 1
        del held
        assert r.busy() == []
    finally:
        gc.enable()
    r.close()
    a.close()


def test_lent_rows_outlive_the_worker_arena(prefix):
    """A lent tensor keeps its own mapping: the worker releasing (unlinking) the slab, or the
    engine shutting down, does not take the caller's data away."""

    hidden, dtype = 64, torch.float32
    a, blocks = _filled_arena(prefix, hidden, dtype, [9])
    r = handoff.ArenaReader(threads=1, lend=True)
    t = r.assemble(blocks, hidden, dtype)
    want = t.clone()
    a.close()
    r.forget_except([])
    r.close()
    assert glob.glob(prefix + "*") == []
    assert torch.equal(t, want)


def test_copy_mode_lends_nothing(prefix):

    hidden, dtype = 64, torch.float32
    a, blocks = _filled_arena(prefix, hidden, dtype, [9])
    r = handoff.ArenaReader(threads=1, lend=False)
    t = r.assemble(blocks, hidden, dtype)
    assert r.busy() == [] and torch.equal(t, a.view(a.cur, blocks[0][1], 9, hidden, dtype))
    a.close()


def test_free_slabs_kept_up_to_the_recent_peak_then_released(prefix, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(arena_mod.time, "monotonic", lambda: clock[0])
    a = arena_mod.Arena(prefix, pin=False)
    held = []
    for _ in range(5):  # a write queue holding up to five batches at once
        a.prepare(1 << 20, busy=held)
        held.append(a.path(a.cur))
    assert len(a.slabs) == 5
    a.prepare(1 << 20)  # all returned: the recent peak (6 in use) is kept for the next batches
    assert len(a.slabs) == 5
    for _ in range(3 * arena_mod.Arena.RECENT):  # many quick batches holding nothing, within KEEP_S:
        clock[0] += 0.1  # the peak stays (a write queue needs those slabs again)
        a.prepare(1 << 20)
    assert len(a.slabs) == 5 and a._n == 5
    clock[0] += a.keep_s + 1  # and then older than both windows: back to the spare count
    a.prepare(1 << 20)
    assert len(a.slabs) == 1 + arena_mod.Arena.SPARE
    a.close()


def test_a_zero_keep_window_keeps_only_the_recent_batch_count(prefix, monkeypatch):
    a = arena_mod.Arena(prefix, pin=False)
    a.keep_s = 0.0
    held = []
    for _ in range(4):
        a.prepare(1 << 20, busy=held)
        held.append(a.path(a.cur))
    for _ in range(arena_mod.Arena.RECENT + 1):  # window 0 s: only the batch count keeps the peak
        a.prepare(1 << 20)
    assert len(a.slabs) == 1 + arena_mod.Arena.SPARE
    a.close()


def test_sweep_removes_only_files_of_engines_that_are_gone(tmp_path):
    """A group of hand-off files is stale when nobody holds its lock: a live engine's (lock held,
    here by another process) and a lock-less group stay; a group whose holder died goes."""
    import subprocess
    import sys

    d = str(tmp_path)
    dead = os.path.join(d, "speculators-compat-0000dead-")
    live = os.path.join(d, "speculators-compat-0000a11e-")
    for p in (dead, live):
        (tmp_path / (os.path.basename(p) + "arena1")).write_bytes(b"x")
        (tmp_path / (os.path.basename(p) + "arena2")).write_bytes(b"x")
    (tmp_path / "speculators-compat-00001e9a-arena1").write_bytes(b"x")  # no lock file (older release)
    (tmp_path / "unrelated").write_bytes(b"x")
    # the dead engine held its lock in a process that has exited
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[2]); "
            "from speculators_compat.engine import handoff; handoff.hold_handoff_lock(sys.argv[1])",
            dead,
            os.getcwd(),
        ],
        check=True,
    )
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[2]); "
            "from speculators_compat.engine import handoff; handoff.hold_handoff_lock(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)",
            live,
            os.getcwd(),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = handoff.sweep_stale_handoff_files(d)
        assert sorted(removed) == sorted(os.path.basename(dead) + x for x in ("arena1", "arena2", "lock"))
        assert sorted(os.listdir(d)) == sorted(
            [os.path.basename(live) + x for x in ("arena1", "arena2", "lock")]
            + ["speculators-compat-00001e9a-arena1", "unrelated"]
        )
        with pytest.raises(OSError):  # and a second engine cannot take a live engine's lock
            handoff.hold_handoff_lock(live)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(handoff.sweep_stale_handoff_files(d)) == sorted(
        os.path.basename(live) + x for x in ("arena1", "arena2", "lock")
    )


def test_no_collection_while_the_worker_has_a_free_slab(prefix):
    """A pipeline holds the last batch's rows on purpose: while the worker still has a slab
    nobody holds, busy() collects nothing (the rows held by a garbage cycle stay counted busy);
    once every slab the worker has is busy, it collects and the garbage's slab comes back."""
    import gc

    hidden, dtype = 32, torch.float32
    a, blocks = _filled_arena(prefix, hidden, dtype, [4])
    path = blocks[0][0]
    r = handoff.ArenaReader(threads=1, lend=True)
    holder = [r.assemble(blocks, hidden, dtype)]
    holder.append(holder)
    del holder  # garbage in a cycle: only a collection frees it
    gc.disable()
    try:
        before = r.full_collections
        assert r.busy(slabs=[path, prefix + "another-free-slab"]) == [path]
        assert r.full_collections == before
        assert r.busy(slabs=[path]) == []  # no free slab left: collect
    finally:
        gc.enable()
    r.close()
    a.close()


def _slabs_made_for(needs, prefix, depth=3):
    """Prepare one batch after another, each slab busy (lent to a write queue) until ``depth``
    later batches have started; return how many slabs the arena made after the first ``depth + 1``."""
    a = arena_mod.Arena(prefix, pin=False)
    lent = []
    made_at_warm = None
    for i, need in enumerate(needs):
        a.prepare(need, busy=[a.path(k) for k in lent])
        a.alloc(need)
        lent.append(a.cur)
        lent = lent[-depth:]
        if i == depth:
            made_at_warm = a._n
    made = a._n - made_at_warm
    a.close()
    return made


def test_slabs_have_headroom_so_mixed_batch_sizes_reuse_them(prefix):
    """Batches of 32 prompts of 100-2,000 tokens vary by ~10% in bytes. A slab made exactly to its
    batch's size is too small for the next larger batch, so a pipeline kept making (and, on a
    GPU, page-locking) new slabs. Made with headroom over the largest batch seen, the slabs of
    the first few batches serve the rest."""
    g = torch.Generator().manual_seed(0)
    row = 512  # bytes a token (any size: only the ratios matter)
    needs = [int(torch.randint(100, 2001, (32,), generator=g).sum()) * row for _ in range(40)]
    assert max(needs) / min(needs) > 1.15  # the spread this test is about
    assert _slabs_made_for(needs, prefix) == 0
    assert glob.glob(prefix + "*") == []


def test_headroom_falls_back_to_the_exact_size_when_shm_is_short(prefix, monkeypatch):
    # seam: a /dev/shm with room for the batch but not for its headroom (cannot be made unprivileged)
    real = os.posix_fallocate
    limit = 5 << 20

    def short(fd, off, size):
        if size > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, off, size)

    monkeypatch.setattr(os, "posix_fallocate", short)
    a = arena_mod.Arena(prefix, pin=False)
    a.prepare(limit)
    assert a.capacity == limit and len(glob.glob(prefix + "*")) == 1
    a.close()


def _pipeline_slabs(needs, prefix, depths, want=None):
    """Prepare ``needs`` one after another, each slab lent (busy) until ``depths[i]`` later batches
    have started (a write queue whose backlog varies); -> slabs made after the first batch."""
    a = arena_mod.Arena(prefix, pin=False)
    lent = []
    for i, (need, depth) in enumerate(zip(needs, depths)):
        a.prepare(need, busy=[a.path(k) for k in lent], want=want if i == 0 else None)
        a.alloc(need)
        if i == 0:
            made_first = a._n
        lent = (lent + [a.cur])[-depth:] if depth else []
    made = a._n - made_first
    a.close()
    return made


def test_slabs_asked_for_are_made_at_the_first_batch(prefix):
    """A pipeline holds up to queue_size + 1 batches in its writer; how many it holds depends on
    how far the writers lag. Made as needed, each deeper backlog makes a slab mid-run (on a GPU:
    ~0.3 s of engine time each, measured); asked for ahead, all are made at the first batch."""
    needs = [10 << 20] * 30
    depths = [1] * 10 + [2] * 10 + [3] * 10  # writers falling behind as the run goes on
    assert _pipeline_slabs(needs, prefix, depths) == 3  # at the 2nd, 11th and 21st batch
    assert _pipeline_slabs(needs, prefix, depths, want=4) == 0
    a = arena_mod.Arena(prefix, pin=False)
    a.prepare(10 << 20, want=4)
    assert len(a.slabs) == 4 and a.want == 4
    assert all(s[1].numel() >= int(1.25 * (10 << 20)) for s in a.slabs.values())  # with headroom
    a.prepare(10 << 20)  # nothing lent, want kept: the four stay
    assert len(a.slabs) == 4
    a.close()
    assert glob.glob(prefix + "*") == []


def test_slabs_asked_for_stop_at_a_full_shm(prefix, monkeypatch, caplog):
    # seam: a /dev/shm with room for two slabs only (cannot be made unprivileged)
    real = os.posix_fallocate
    made = []

    def short(fd, off, size):
        if len(made) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        made.append(size)
        return real(fd, off, size)

    monkeypatch.setattr(os, "posix_fallocate", short)
    a = arena_mod.Arena(prefix, pin=False)
    with caplog.at_level("INFO"):
        a.prepare(1 << 20, want=4)  # the batch itself is placed; the rest is not an error
    assert a.capacity >= 1 << 20 and len(a.slabs) == 2 and a.want == 2
    assert "made 2 of the 4 hand-off slabs" in caplog.text
    a.close()
    assert glob.glob(prefix + "*") == []


def test_slabs_asked_for_stay_through_the_keep_window_after_the_ask_ends(prefix, monkeypatch):
    """A pipeline's ask ends with the pipeline. Plain calls right after it (a benchmark alternates
    them with pipeline runs) must not release what the next pipeline run asks for again: on the
    H200 each such slab was released (~0.11 s) and made again (~0.35 s). They go once older than
    both keep windows, as any recent peak does."""
    clock = [1000.0]
    monkeypatch.setattr(arena_mod.time, "monotonic", lambda: clock[0])
    a = arena_mod.Arena(prefix, pin=False)
    a.prepare(1 << 20, want=4)
    for _ in range(5):  # a pipeline whose writers keep up: nothing is held at the next batch
        clock[0] += 0.1
        a.prepare(1 << 20)
    made = a._n
    a.prepare(1 << 20, want=0)  # the pipeline is done
    for _ in range(3 * arena_mod.Arena.RECENT):  # quick plain calls within KEEP_S
        clock[0] += 0.1
        a.prepare(1 << 20)
    assert len(a.slabs) == 4
    a.prepare(1 << 20, want=4)  # the next pipeline run finds them
    assert a._n == made
    a.prepare(1 << 20, want=0)
    for _ in range(arena_mod.Arena.RECENT + 1):
        a.prepare(1 << 20)
    clock[0] += a.keep_s + 1
    a.prepare(1 << 20)
    assert len(a.slabs) == 1 + arena_mod.Arena.SPARE
    a.close()

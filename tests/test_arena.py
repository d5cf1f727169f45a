"""The worker's hand-off arena and row plan (engine/worker.py), without an engine.

The real-engine tests (tests/engine) run the same code inside vLLM workers; these pin down the
edge cases an engine run rarely reaches: growth in the middle of a batch, a full /dev/shm, rows of
requests that are not ours in the middle of a step.
"""
import errno
import glob
import os

import pytest

torch = pytest.importorskip("torch")

from speculators_compat.engine import worker as w  # noqa: E402


@pytest.fixture
def prefix(tmp_path):
    return str(tmp_path / "sc-test-")


def test_growth_keeps_earlier_blocks_until_reset(prefix):
    a = w._Arena(prefix, pin=False)
    a.reserve(1 << 20)
    b0, o0 = a.alloc(512 * 1024)
    a.view(b0, o0, 1024, 128, torch.float32).fill_(1.5)
    b1, o1 = a.alloc(3 << 20)  # does not fit: a second, larger buffer
    assert b1 == b0 + 1 and o1 == 0
    a.view(b1, o1, 2048, 128, torch.float32).fill_(-2.0)
    assert a.view(b0, o0, 1024, 128, torch.float32).eq(1.5).all()  # the first block is intact
    assert len(glob.glob(prefix + "*")) == 2
    a.reset()
    assert len(glob.glob(prefix + "*")) == 1 and a.used == 0  # only the largest stays
    a.close()
    assert glob.glob(prefix + "*") == []


def test_blocks_are_aligned(prefix):
    a = w._Arena(prefix, pin=False)
    offs = [a.alloc(n)[1] for n in (3, 100, 2, 64, 1)]
    assert all(o % w.SHM_ALIGN == 0 for o in offs)
    a.close()


def test_full_shm_is_a_clear_error_and_leaves_nothing(prefix, monkeypatch):
    # A full /dev/shm cannot be produced without privileges here: this seam stands in for
    # posix_fallocate's ENOSPC (what a docker container's 64 MiB /dev/shm gives).
    def full(fd, off, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    a = w._Arena(prefix, pin=False)
    with pytest.raises(w.ArenaSpaceError, match=r"shm-size.*SPECULATORS_COMPAT_HANDOFF=rpc"):
        a.reserve(10 << 20)
    assert glob.glob(prefix + "*") == []


def test_memory_arena_for_rpc_handoff():
    a = w._Arena(None, pin=False)
    b, o = a.alloc(4096)
    assert a.path(b) is None
    a.view(b, o, 4, 256, torch.float32).fill_(3.0)
    assert w._gather(a, [(b, o, 4)], 256, torch.float32).eq(3.0).all()
    a.close()


def _state(expected, hidden=8):
    st = w._CaptureState(layer_ids=[0])
    st.expected, st.hidden, st.dtype = dict(expected), hidden, torch.float32
    return st


def test_plan_contiguous_rows_use_a_slice():
    st = _state({"a": 10, "b": 4})
    source, kept = w._plan_rows(st, ["a", "b"], [6, 4], [0, 0], None)
    assert source == slice(0, 10)
    assert kept == [("a", 0, 6, 0), ("b", 0, 4, 6)]


def test_plan_skips_foreign_and_decode_rows():
    # "x" is not ours; "b" is past its prompt (a decode row): neither is kept, and the rows of
    # "c" behind them are picked by index, not by offset
    st = _state({"a": 10, "b": 3, "c": 5})
    source, kept = w._plan_rows(st, ["a", "x", "b", "c"], [4, 2, 1, 5], [6, 0, 3, 0], None)
    assert kept == [("a", 6, 4, 0), ("c", 0, 5, 4)]
    assert source.tolist() == [0, 1, 2, 3, 7, 8, 9, 10, 11]


def test_plan_trims_rows_past_the_prompt():
    st = _state({"a": 5})
    source, kept = w._plan_rows(st, ["a"], [4], [3], None)
    assert kept == [("a", 3, 2, 0)] and source == slice(0, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_flag_catches_every_bad_value(bad):
    t = torch.randn(64, 32).bfloat16()
    assert not bool(w._nonfinite_flag(t))
    t[17, 5] = bad
    assert bool(w._nonfinite_flag(t))


def test_driver_never_poisons_fork_before_the_engine_starts(monkeypatch):
    """torch.cuda.is_available() calls cudaGetDeviceCount, which poisons fork: vLLM then forks its
    GPU workers (CUDA not initialised) and they die at start-up (seen on an H200 with the extract
    CLI). This CPU machine has no CUDA, so the seam is replaced: any call to is_available fails."""
    from speculators_compat import generator
    from speculators_compat.engine import core

    def poisoned():
        raise AssertionError("torch.cuda.is_available() called in the driver")

    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    generator._check_devices(1)
    assert core._ArenaReader("auto").mode in ("pinned", "malloc")
    from speculators_compat.pipeline import plan

    plan._detect_gpu_gib()


def test_threaded_copy_out_equals_single_thread_and_owns_storage(prefix):
    """The driver's copy-out with a thread pool must give exactly the single-thread result, each
    tensor owning exactly its rows, for requests whose layers span several blocks and files."""
    from speculators_compat.engine import core

    hidden, dtype = 1024, torch.bfloat16
    a = w._Arena(prefix, pin=False)
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
    one = core._ArenaReader("malloc", threads=1).assemble_all(states, hidden, dtype)
    reader = core._ArenaReader("malloc", threads=3)
    many = reader.assemble_all(states, hidden, dtype)
    assert reader._pool is not None, "three threads must use the pool"
    assert list(many) == list(one)
    for r in one:
        for x, y in zip(one[r], many[r]):
            assert torch.equal(x, y)
            assert y.untyped_storage().nbytes() == y.numel() * y.element_size()
    reader.close()
    a.close()


def test_copy_threads_auto(monkeypatch):
    from speculators_compat.engine import core

    monkeypatch.delenv(core.COPY_THREADS_ENV, raising=False)
    assert core._ArenaReader("malloc").threads == 1  # CPU hosts: the engine needs the cores
    assert 1 <= core.auto_copy_threads("pinned") <= 8
    monkeypatch.setenv(core.COPY_THREADS_ENV, "3")
    assert core._ArenaReader("malloc").threads == 3


@pytest.mark.parametrize("bad", ["0", "-2", "four"])
def test_copy_threads_env_is_checked(monkeypatch, bad):
    from speculators_compat.engine import core

    monkeypatch.setenv(core.COPY_THREADS_ENV, bad)
    with pytest.raises(ValueError, match="SPECULATORS_COMPAT_COPY_THREADS"):
        core._ArenaReader("malloc")

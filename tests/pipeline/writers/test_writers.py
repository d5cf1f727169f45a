"""The writers (pipeline/writers/): threads and processes, the same files, failures named."""

import io
import json
import os

import pytest

from speculators_compat.errors import OutputError
from speculators_compat.pipeline.output.outdir import OutputDir
from tests.pipeline.helpers import lent_samples


def test_writer_failure_surfaces_and_keeps_written_files(small_disk):
    """A real full disk (a 1 MiB tmpfs): the error names it, files already recorded stay whole."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    disk = small_disk("1m")
    out = OutputDir(disk)
    out.prepare({"m": 1})
    bw = w.BackgroundWriter(out, queue_size=1)
    sample = {"input_ids": torch.tensor([1, 2]), "hidden_states": [torch.zeros(2, 4)], "loss_mask": torch.ones(2)}
    bw.put([(0, sample)])
    big = {"input_ids": torch.arange(64), "hidden_states": [torch.zeros(64, 1024)], "loss_mask": torch.ones(64)}
    with pytest.raises(OutputError, match="No space left on device"):
        for i in range(1, 50):
            bw.put([(i, big)])
        bw.close()
    assert torch.load(disk / "data_0.pt", weights_only=True)["input_ids"].tolist() == [1, 2]
    assert not list(disk.glob(".data_*.partial"))
    recorded = [json.loads(line) for line in (disk / "checksums.jsonl").read_text().splitlines()]
    assert recorded and all(r["durable"] for r in recorded)
    for r in recorded:
        assert torch.load(disk / r["file"], weights_only=True)["input_ids"].numel() > 0


@pytest.mark.parametrize("threads", [1, 3])
def test_parallel_writer_writes_every_file_with_its_checksum(tmp_path, threads):
    torch = pytest.importorskip("torch")
    import zlib

    from speculators_compat.pipeline.writers import threads as w

    out = OutputDir(tmp_path)
    out.prepare({"m": 1})
    bw = w.BackgroundWriter(out, queue_size=1, threads=threads)
    for b in range(4):
        bw.put(
            [
                (
                    b * 5 + i,
                    {
                        "input_ids": torch.arange(3 + i),
                        "hidden_states": [torch.full((3 + i, 8), float(i))],
                        "loss_mask": torch.ones(3 + i, dtype=torch.long),
                    },
                )
                for i in range(5)
            ]
        )
    bw.close()
    recs = [json.loads(line) for line in (tmp_path / "checksums.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in recs) == list(range(20))
    for r in recs:
        data = (tmp_path / r["file"]).read_bytes()
        assert f"{zlib.crc32(data):08x}" == r["crc32"] and len(data) == r["bytes"]  # the default checksum
        assert torch.load(tmp_path / r["file"], weights_only=True)["input_ids"].numel() == r["tokens"]


def test_writer_threads_must_be_positive(tmp_path):
    from speculators_compat.pipeline.writers import threads as w

    out = OutputDir(tmp_path)
    out.prepare({"m": 1})
    with pytest.raises(ValueError, match="writer threads"):
        w.BackgroundWriter(out, threads=0)


def test_default_writer_threads_scale_with_cpus(monkeypatch):
    from speculators_compat import host
    from speculators_compat.pipeline.writers import threads as writer

    for cpus, want in [(1, 1), (2, 2), (4, 2), (16, 8), (128, 8)]:
        monkeypatch.setattr(host.os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert writer.default_writer_threads() == want


def _write_with_both(tmp_path, items, reader, fmt="pt", split=3, workers=2):
    """Write ``items`` (two batches, split at ``split``) with the thread writer and with the process
    writer; returns, per writer, its data files' bytes, its sorted checksums and the writer."""

    from speculators_compat.pipeline.writers import processes as w
    from speculators_compat.pipeline.writers.threads import BackgroundWriter

    got = {}
    for kind in ("thread", "process"):
        out = OutputDir(tmp_path / kind, fmt)
        out.prepare({"m": 1})
        bw = (
            w.ProcessWriter(out, reader.describe, queue_size=1, processes=workers)
            if kind == "process"
            else BackgroundWriter(out, queue_size=1, threads=workers)
        )
        bw.put(items[:split])
        bw.put(items[split:])
        bw.close()
        files = {p.name: p.read_bytes() for p in (tmp_path / kind).glob("data_*")}
        recs = [json.loads(x) for x in (tmp_path / kind / "checksums.jsonl").read_text().splitlines()]
        for r in recs:  # (a writer process reads it itself: the driver does not stat the file)
            assert r["mtime_ns"] == (tmp_path / kind / r["file"]).stat().st_mtime_ns, (kind, r)
        got[kind] = (files, sorted(r["crc32"] for r in recs), bw)
    return got


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_process_writer_writes_the_bytes_the_thread_writer_writes(tmp_path, fmt):
    arena, reader, items = lent_samples(tmp_path)
    assert all(reader.describe(h) is not None for _, s in items for h in s["hidden_states"])
    got = _write_with_both(tmp_path, items, reader, fmt)
    bw = got["process"][2]
    assert bw.in_processes == len(items) and bw.on_threads == 0
    assert len(got["thread"][0]) == len(items)
    assert got["process"][:2] == got["thread"][:2]
    for files, _, writer in got.values():  # both count the bytes they wrote (the run's write rate)
        assert writer.bytes_written == sum(len(b) for b in files.values()) > 0
    del items, got, bw, writer
    import gc

    gc.collect()
    assert reader.busy() == []  # the writer let go of every sample once written
    arena.close()


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_layer_listed_twice_is_written_by_both_writers(tmp_path, fmt):
    """Upstream's default ids [2, n//2, n-3, n-1] list layer 3 twice on a 6-layer model, and the
    generator then returns one state twice (seen: the same lent rows). safetensors refuses two
    tensors over the same memory; before the fix the pipeline failed on its first file in that
    format (found by the benchmark on the tiny Llama with the default ids)."""
    torch = pytest.importorskip("torch")
    arena, reader, items = lent_samples(tmp_path)
    items = [
        (i, {**s, "hidden_states": [s["hidden_states"][0], s["hidden_states"][1], s["hidden_states"][1]]})
        for i, s in items
    ]
    got = _write_with_both(tmp_path, items, reader, fmt)
    assert got["process"][:2] == got["thread"][:2] and len(got["thread"][0]) == len(items)
    for i, s in items:
        p = tmp_path / "thread" / f"data_{i}.{fmt}"
        if fmt == "pt":
            hs = torch.load(p, weights_only=True)["hidden_states"]
        else:
            from safetensors.torch import load_file

            d = load_file(str(p))
            hs = [d[f"hidden_states_{j}"] for j in range(3)]
        assert torch.equal(hs[0], s["hidden_states"][0])
        assert torch.equal(hs[1], s["hidden_states"][1]) and torch.equal(hs[2], s["hidden_states"][1])
    del items, got
    import gc

    gc.collect()
    arena.close()


def test_process_writer_unlent_rows_go_to_a_thread(tmp_path):
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import processes as w

    out = OutputDir(tmp_path / "o")
    out.prepare({"m": 1})
    bw = w.ProcessWriter(out, lambda t: None, queue_size=1, processes=1)
    bw.put([(0, {"input_ids": torch.arange(4), "hidden_states": [torch.ones(4, 8)], "loss_mask": torch.ones(4)})])
    bw.close()
    assert bw.on_threads == 1 and bw.in_processes == 0
    assert torch.load(tmp_path / "o" / "data_0.pt", weights_only=True)["hidden_states"][0].sum() == 32


def test_killed_writer_process_is_a_clear_error_not_a_hang(tmp_path):
    import signal
    import time

    from speculators_compat.pipeline.writers import processes as w

    arena, reader, items = lent_samples(tmp_path)
    out = OutputDir(tmp_path / "o")
    out.prepare({"m": 1})
    bw = w.ProcessWriter(out, reader.describe, queue_size=1, processes=1)
    bw.put(items[:2])
    deadline = time.time() + 60
    while bw.written < 2:
        assert time.time() < deadline and bw.error is None, f"first files not written: {bw.error}"
        time.sleep(0.02)
    os.kill(bw.pool.procs[0].proc.pid, signal.SIGKILL)
    t = time.time()
    with pytest.raises(OutputError, match=r"writer process .* died"):
        for i in range(2, len(items)):
            bw.put([items[i]])
        bw.close()
    assert time.time() - t < 30
    assert sorted(p.name for p in (tmp_path / "o").glob("data_*")) == ["data_0.pt", "data_1.pt"]
    # the next run gets fresh processes
    out2 = OutputDir(tmp_path / "o2")
    out2.prepare({"m": 1})
    bw2 = w.ProcessWriter(out2, reader.describe, queue_size=1, processes=1)
    assert not bw2.pool.dead()
    bw2.put(items[2:4])
    bw2.close()
    assert bw2.in_processes == 2 and (tmp_path / "o2" / "data_3.pt").exists()
    arena.close()


def test_process_writer_needs_no_driver_thread(tmp_path):
    """The engine's driver thread holds the GIL while it waits for the engine (vLLM spins), so
    the process writer must not need any other driver thread to hand work over: put() writes
    the task into the pipe itself. Here the caller holds the GIL in one C call (a long ``sum``)
    right after put(); the files must appear meanwhile. With the multiprocessing.Queue used before
    (its feeder thread pickles and sends) they did not: none of the 3, or 1 missing, in runs
    on this machine."""
    import time

    from speculators_compat.pipeline.writers import processes as w

    arena, reader, items = lent_samples(tmp_path)
    warm = OutputDir(tmp_path / "warm")  # start the process (torch import) outside the timing
    warm.prepare({"m": 1})
    bw = w.ProcessWriter(warm, reader.describe, queue_size=1, processes=1)
    bw.put(items[:1])
    bw.close()
    out = OutputDir(tmp_path / "o")
    out.prepare({"m": 1})
    bw = w.ProcessWriter(out, reader.describe, queue_size=1, processes=1)
    names = [tmp_path / "o" / f"data_{i}.pt" for i, _ in items[1:4]]
    bw.put(items[1:4])
    t = time.perf_counter()
    sum(range(150_000_000))  # ~1.5 s in one C call: no bytecode runs, so no other thread gets the GIL
    held = time.perf_counter() - t
    appeared = [p.exists() for p in names]
    assert all(appeared), f"files written while the driver held the GIL for {held:.2f} s: {appeared}"
    bw.close()
    assert bw.written == 3
    arena.close()


def test_process_writer_feeds_tasks_larger_than_the_pipe(tmp_path, monkeypatch):
    """A batch's tasks may not fit in a pipe (64 KiB when it cannot be grown): put() keeps the rest
    and writes it at the next chance instead of blocking the engine's thread; every file arrives
    and matches the thread writer's."""
    from speculators_compat.pipeline.writers import processes as w

    monkeypatch.setattr(w, "_grow_pipe", lambda fd: 0)  # keep the OS default pipe size
    full = []
    flush = w._WriterProc.flush

    def counting_flush(self):
        done = flush(self)
        full.append(not done)
        return done

    monkeypatch.setattr(w._WriterProc, "flush", counting_flush)
    w.shutdown_writer_pool()  # (a pool started earlier has grown pipes)
    arena, reader, items = lent_samples(tmp_path, n=12, rows=(4096, 3000), hidden=8, arena_bytes=1 << 22)
    task_bytes = sum(s["input_ids"].numel() * 16 for _, s in items)  # ids + loss mask, int64
    assert task_bytes > 4 * 65536
    got = _write_with_both(tmp_path, items, reader, split=6, workers=1)
    assert any(full), "the tasks never filled the pipe: the test did not exercise the outbox"
    assert len(got["process"][0]) == len(items) and got["process"][:2] == got["thread"][:2]
    w.shutdown_writer_pool()
    arena.close()


def test_process_writer_failure_names_the_sample(tmp_path):
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import processes as w

    out = OutputDir(tmp_path / "o")
    out.prepare({"m": 1})
    bw = w.ProcessWriter(out, lambda t: ("/nonexistent/arena", 0, int(t.shape[0])), queue_size=1, processes=1)
    bw.put([(7, {"input_ids": torch.arange(2), "hidden_states": [torch.ones(2, 8)], "loss_mask": torch.ones(2)})])
    with pytest.raises(OutputError, match=r"sample 7 failed: FileNotFoundError"):
        bw.close()


@pytest.mark.parametrize("pt_writer", ["torch", "direct"])
@pytest.mark.parametrize("rows", [3, 4096])  # in-memory and streamed writes
def test_written_states_are_not_kept_alive_by_torch_save(tmp_path, rows, pt_writer, monkeypatch):
    """torch.save in torch 2.8 and 2.9 leaves a garbage cycle that references every storage it
    saved (a per-call pickler class; so this fails there without the fix, not on torch >= 2.10). write_sample saves aliases, so the caller's storage dies as soon as the
    caller drops it, with the GC off; the file's bytes are those torch.save gives the original."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    import numpy as np

    from speculators_compat.files.formats import write_sample

    buf = np.frombuffer(bytearray(torch.randn(rows, 64).numpy().tobytes()), dtype=np.float32)
    died = []
    weakref.finalize(buf, died.append, True)
    h = torch.from_numpy(buf).view(rows, 64)
    # (h twice: torch.save stores one storage for both, and so must the aliases)
    sample = {"input_ids": torch.arange(rows), "hidden_states": [h, h[:1].clone(), h], "loss_mask": torch.ones(rows)}
    monkeypatch.setenv("SPECULATORS_COMPAT_PT_WRITER", pt_writer)
    ref = io.BytesIO()  # (write_sample saves to unnamed files too: the archive inside gets one name)
    torch.save(sample, ref)
    gc.collect()  # (that save's own cycle)
    gc.disable()
    try:
        write_sample(tmp_path / "data_0.pt", sample, "pt")
        del sample, h, buf
        assert died == [True], "the saved storage is still referenced after the caller dropped it"
    finally:
        gc.enable()
    assert (tmp_path / "data_0.pt").read_bytes() == ref.getvalue()


def test_default_writer_processes_leave_the_engine_its_cores(mocker):
    """GPU hosts: one CPU for the driver, one spare and one per engine worker stay free, the rest
    write (2..16); CPU hosts: half. The GPU branch needs a CUDA device, so the device count is mocked
    here (the seam a CPU machine cannot reach); the CPU count is mocked to make cases."""
    from speculators_compat.pipeline.writers import processes as procwriter
    from speculators_compat.pipeline.writers.processes import default_writer_processes

    cases = {
        (16, 1, True): 13,
        (16, 8, True): 6,
        (192, 8, True): 16,
        (4, 2, True): 2,
        (26, 8, True): 16,
        (25, 8, True): 15,
        (2, None, False): 2,
        (16, None, False): 8,
        (64, 8, False): 16,
    }
    for (cpus, tp, gpu), want in cases.items():
        mocker.patch.object(procwriter, "usable_cpus", return_value=cpus)
        mocker.patch.object(procwriter, "cuda_device_count", return_value=1 if gpu else 0)
        assert default_writer_processes(tp) == want, (cpus, tp, gpu)


def test_waiting_for_writer_processes_to_start_is_not_counted_as_a_slow_disk(tmp_path):
    """A fresh writer process spends 1-3 s importing torch before it reads a task. A run that
    fills its queue meanwhile waits for the start-up, not for the disk: that time goes to
    start_wait_s, and wait_s (what the write-bound warning reads) holds only the rest. Before,
    all of it was wait_s, and a short run on a GPU host with a new pool warned that its disk
    was slow (seen on the H200: "waited 2.8 s of 4.8 s", writing to a disk that keeps 1.2 GiB/s)."""
    import time

    from speculators_compat.pipeline.writers import processes as w

    arena, reader, items = lent_samples(tmp_path)
    w.shutdown_writer_pool()  # a pool whose process has not started yet
    out = OutputDir(tmp_path / "o")
    out.prepare({"m": 1})
    t = time.perf_counter()
    bw = w.ProcessWriter(out, reader.describe, queue_size=1, processes=1)
    for item in items[:4]:  # one sample a batch; the third put waits (2 batches in flight at most)
        bw.put([item])
    bw.close()
    took = time.perf_counter() - t
    assert (tmp_path / "o" / "data_3.pt").exists()
    assert bw.start_wait_s > 0.2, (bw.start_wait_s, bw.wait_s, bw.tail_s)  # torch import: >0.2 s anywhere
    assert bw.wait_s + bw.tail_s < 0.5 * bw.start_wait_s, (bw.start_wait_s, bw.wait_s, bw.tail_s)
    assert bw.start_wait_s + bw.wait_s + bw.tail_s <= took
    # the same pool again: it has started, nothing is start-up
    out2 = OutputDir(tmp_path / "o2")
    out2.prepare({"m": 1})
    bw2 = w.ProcessWriter(out2, reader.describe, queue_size=1, processes=1)
    for item in items[:4]:
        bw2.put([item])
    bw2.close()
    assert bw2.start_wait_s == 0.0 and (tmp_path / "o2" / "data_3.pt").exists()
    arena.close()


def test_a_full_disk_in_a_writer_process_is_told_apart(small_disk):
    """A writer process's ENOSPC reaches the run as a full disk (its errno kept across the pipe),
    which extract turns into 'no space left on DIR: N GB more needed'."""
    from speculators_compat.pipeline.preflight import disk_full
    from speculators_compat.pipeline.writers import processes as w

    disk = small_disk("1m")
    arena, reader, items = lent_samples(disk.parent, n=6, rows=(600,), hidden=256, arena_bytes=8 << 20)
    out = OutputDir(disk)
    out.prepare({"m": 1})
    bw = w.ProcessWriter(out, reader.describe, queue_size=1, processes=1)
    with pytest.raises(OutputError) as err:
        for i in range(len(items)):
            bw.put([items[i]])
        bw.close()
    assert disk_full(err.value), repr(err.value)
    assert "No space left on device" in str(err.value)
    w.shutdown_writer_pool()
    arena.close()

"""Pipeline pieces without an engine: dataset parsing errors, output-dir guards, writer failures."""

import io
import json
import os

import pytest

from speculators_compat.errors import OutputError
from speculators_compat.pipeline.dataset import DatasetError, open_dataset
from speculators_compat.pipeline.output.outdir import OutputDir


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_ok(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, "", {"input_ids": [4]}])
    got = list(open_dataset(f))
    assert [(s.index, s.input_ids, s.loss_mask) for s in got] == [(0, [1, 2, 3], [0, 1, 1]), (1, [4], None)]


def test_jsonl_with_a_byte_order_mark_and_crlf(tmp_path):
    # (a file saved by Windows tools: before, line 1 was "malformed JSON (Unexpected UTF-8 BOM)")
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2]}\r\n{"input_ids": [3], "loss_mask": [1]}\r\n')
    assert [(s.input_ids, s.loss_mask) for s in open_dataset(f)] == [([1, 2], None), ([3], [1])]
    f.write_bytes(b'{"input_ids": [1]}\n\xef\xbb\xbf{"input_ids": [3]}\n')  # one mid-file is still an error
    with pytest.raises(DatasetError, match="bom.jsonl:2: malformed JSON"):
        list(open_dataset(f))


@pytest.mark.parametrize(
    "line,text",
    [
        ('{"input_ids": [1, 2', "d.jsonl:2: malformed JSON"),
        ('{"ids": [1]}', "d.jsonl:2: input_ids must be a non-empty list"),
        ('{"input_ids": []}', "non-empty"),
        ('{"input_ids": [1, -2]}', "holds -2"),
        ('{"input_ids": [1, "x"]}', "holds 'x'"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "as long as input_ids"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 7]}', "0/1"),
        ("[1, 2, 3]", "expected an object"),
        (
            '{"conversations": [{"from": "human", "value": "hi"}]}',
            "this sample has conversations: the input must be tokenized already",
        ),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, text):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1]}, line])
    with pytest.raises(DatasetError, match=text):
        list(open_dataset(f))


def test_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_dataset(tmp_path / "nope.jsonl")


def test_directory_without_dataset(tmp_path):
    with pytest.raises(DatasetError, match="saved dataset"):
        open_dataset(tmp_path)


def test_arrow_dataset_dir(tmp_path):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"input_ids": [[5, 6, 7], [8]], "loss_mask": [[0, 1, 1], [1]]})
    with pa.OSFile(str(tmp_path / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    got = [(s.input_ids, s.loss_mask) for s in open_dataset(tmp_path)]
    assert got == [([5, 6, 7], [0, 1, 1]), ([8], [1])]


def _saved_derived_dataset(tmp_path):
    """A dataset as users make one: loaded from JSON (so its info records 50 examples), shuffled,
    cut to 10 by ``select``, mapped, and saved in two shards by ``datasets`` itself."""
    datasets = pytest.importorskip("datasets")
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"input_ids": [1, 2, i], "loss_mask": [0, 1, i % 2]} for i in range(50)])
    d = datasets.load_dataset("json", data_files=str(raw), split="train", cache_dir=str(tmp_path / "cache"))
    d = (
        d.shuffle(seed=0)
        .select(range(10))
        .map(lambda e: {"input_ids": e["input_ids"] + [7], "loss_mask": e["loss_mask"] + [1]})
    )
    d.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    return datasets, tmp_path / "saved"


def test_dataset_saved_by_datasets_reads_as_datasets_does(tmp_path):
    datasets, saved = _saved_derived_dataset(tmp_path)
    want = [(r["input_ids"], r["loss_mask"]) for r in datasets.load_from_disk(str(saved))]
    got = [(s.index, s.input_ids, s.loss_mask) for s in open_dataset(saved)]
    assert got == [(i, ids, mask) for i, (ids, mask) in enumerate(want)]
    assert len(want) == 10 and all(ids[-1] == 7 for ids, _ in want)


def test_saved_dataset_is_counted_from_its_rows_not_its_info(tmp_path):
    # dataset_info.json still says 50 (the JSON file's split): the progress bar's total and the
    # short-last-shard decision on resume were taken from it
    from speculators_compat.pipeline.dataset import count_arrow_rows

    _, saved = _saved_derived_dataset(tmp_path)
    assert json.loads((saved / "dataset_info.json").read_text())["splits"]["train"]["num_examples"] == 50
    assert count_arrow_rows(saved) == 10


def test_saved_dataset_with_torch_format_int32_ids_and_bool_mask(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]], "loss_mask": [[True, False, True], [False]]})
    d = d.cast_column("input_ids", datasets.Sequence(datasets.Value("int32")))
    d.set_format("torch")  # (what speculators' preprocessing leaves set)
    d.save_to_disk(str(tmp_path / "t"))
    got = [(s.input_ids, s.loss_mask) for s in open_dataset(tmp_path / "t")]
    assert got == [([1, 2, 3], [1, 0, 1]), ([4], [0])]
    assert all(type(t) is int for s in open_dataset(tmp_path / "t") for t in s.input_ids + s.loss_mask)


def test_saved_dataset_dict_names_its_splits(tmp_path):
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DatasetError, match=r"saved DatasetDict \(splits: train, test\).*dd/train"):
        open_dataset(tmp_path / "dd")


@pytest.mark.parametrize(
    "state,text",
    [
        ("{not json", "not a saved dataset's state file"),
        ('{"_data_files": [{"name": "x"}]}', "not a saved dataset's state file"),
        ('{"_data_files": []}', "lists no data files"),
        ('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}', "not there: data-00000-of-00001.arrow"),
    ],
)
def test_broken_saved_dataset_is_refused_before_any_sample(tmp_path, state, text):
    (tmp_path / "state.json").write_text(state)
    with pytest.raises(DatasetError, match=text):
        open_dataset(tmp_path)  # (raised by the call itself: before a pipeline starts its engine)


def test_damaged_arrow_file_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    from speculators_compat.pipeline.dataset import count_arrow_rows

    (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff not arrow at all" * 4)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    with pytest.raises(DatasetError, match="data-00000-of-00001.arrow: not a readable Arrow stream"):
        list(open_dataset(tmp_path))
    with pytest.raises(DatasetError, match="not a readable Arrow stream"):
        count_arrow_rows(tmp_path)


def finished_file(root, name: str, data: bytes, index: int | None = None) -> None:
    """A data file as a writer leaves it: on disk, and recorded in checksums.jsonl (size, crc32, time)."""
    import zlib

    p = root / name
    p.write_bytes(data)
    rec = {
        "index": int(name.split("_")[1].split(".")[0]) if index is None else index,
        "file": name,
        "bytes": len(data),
        "tokens": 1,
        "crc32": f"{zlib.crc32(data):08x}",
        "mtime_ns": p.stat().st_mtime_ns,
    }
    with open(root / "checksums.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def test_output_dir_refuses_another_run(tmp_path):
    out = OutputDir(tmp_path / "o")
    assert out.prepare({"model": "a", "layer_ids": [1, 2]}) == set()
    finished_file(tmp_path / "o", "data_0.pt", b"x")  # (with no sample written there is no run to protect)
    with pytest.raises(OutputError, match="layer_ids: \\[1, 2\\] -> \\[1, 3\\]"):
        out.prepare({"model": "a", "layer_ids": [1, 3]})


def test_output_dir_resumes_with_another_batch_size(tmp_path, caplog):
    # (a lower --batch-size is how a user gets past a memory error: refusing it lost the run's files)
    info = {"model": "a", "layer_ids": [1, 2], "batch_size": 32}
    out = OutputDir(tmp_path / "o")
    out.prepare(info)
    finished_file(tmp_path / "o", "data_0.pt", b"x")
    with caplog.at_level("WARNING", logger="speculators_compat"):
        assert OutputDir(tmp_path / "o").prepare(dict(info, batch_size=8)) == {0}
    assert "with batch_size 8 (the run that made it used 32)" in caplog.text
    assert json.loads((tmp_path / "o" / "run.json").read_text())["batch_size"] == 32
    with pytest.raises(OutputError, match=r"holds a different run \(layer_ids: \[1, 2\] -> \[1, 3\]\)"):
        OutputDir(tmp_path / "o").prepare(dict(info, batch_size=8, layer_ids=[1, 3]))  # only what matters is named


def test_output_dir_uncreatable(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot create output directory"):
        OutputDir(tmp_path / "file" / "sub").prepare({})


def test_partial_files_dropped_and_done_detected(tmp_path):
    out = OutputDir(tmp_path)
    out.prepare({"m": 1})
    finished_file(tmp_path, "data_0.pt", b"x")
    (tmp_path / ".data_1.pt.partial").write_bytes(b"half")
    (tmp_path / "data_2.safetensors").write_bytes(b"other format")
    assert out.prepare({"m": 1}) == {0}
    assert not (tmp_path / ".data_1.pt.partial").exists()


def test_writer_failure_surfaces_and_keeps_written_files(tmp_path, mocker):
    """A full disk cannot be produced here: the write itself is the seam we replace (ENOSPC)."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    out = OutputDir(tmp_path)
    out.prepare({"m": 1})
    bw = w.BackgroundWriter(out, queue_size=1)
    sample = {"input_ids": torch.tensor([1, 2]), "hidden_states": [torch.zeros(2, 4)], "loss_mask": torch.ones(2)}
    bw.put([(0, sample)])

    def full(path, sample, fmt, checksum):
        raise OSError(28, "No space left on device")

    import time

    while not (tmp_path / "data_0.pt").exists():
        time.sleep(0.01)
    mocker.patch.object(w, "write_sample", side_effect=full)
    with pytest.raises(OutputError, match="No space left on device"):
        for i in range(1, 50):
            bw.put([(i, sample)])
            time.sleep(0.01)
    with pytest.raises(OutputError):
        bw.close()
    assert torch.load(tmp_path / "data_0.pt", weights_only=True)["input_ids"].tolist() == [1, 2]
    assert not list(tmp_path.glob(".data_*.partial"))
    assert os.path.exists(tmp_path / "checksums.jsonl")


@pytest.mark.parametrize("threads", [1, 3])
def test_parallel_writer_writes_every_file_with_its_checksum(tmp_path, threads):
    torch = pytest.importorskip("torch")
    import json
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


@pytest.mark.parametrize("rows", [128, 1500])  # under and over SMALL_SAMPLE_BYTES (hidden 256, 2 layers)
def test_in_memory_and_streamed_writes_give_the_same_file(tmp_path, monkeypatch, rows):
    """With torch.save, small samples are serialised in memory and written once; big ones stream
    through the hash. Both, and the direct encoder, must write the same bytes (a resumed run stays byte-identical across the threshold) and
    report that file's checksum and size."""
    import hashlib

    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.output import files as writer

    g = torch.Generator().manual_seed(rows)
    sample = {
        "input_ids": torch.arange(rows),
        "loss_mask": torch.ones(rows, dtype=torch.long),
        "hidden_states": [torch.randn(rows, 256, generator=g).bfloat16() for _ in range(2)],
    }
    got = {}
    for name, limit, pt_writer in [("memory", 1 << 40, "torch"), ("stream", 0, "torch"), ("direct", 0, "direct")]:
        monkeypatch.setattr(writer, "SMALL_SAMPLE_BYTES", limit)
        monkeypatch.setenv("SPECULATORS_COMPAT_PT_WRITER", pt_writer)
        p = tmp_path / f"data_{name}.pt"
        digest, n = writer.write_sample(p, sample, "pt", "sha256")
        data = p.read_bytes()
        assert (digest, n) == (hashlib.sha256(data).hexdigest(), len(data))
        assert not list(tmp_path.glob(".*partial"))
        got[name] = data
    assert got["memory"] == got["stream"] == got["direct"]
    back = torch.load(tmp_path / "data_memory.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(back["hidden_states"], sample["hidden_states"]))


def _lent_samples(tmp_path, n=6, rows=(3, 9, 1, 17, 5, 2), hidden=64, arena_bytes=1 << 20):
    """Samples whose hidden states are lent arena rows (a /dev/shm-like file and the engine's own
    reader), as the zero-copy hand-off returns them."""
    torch = pytest.importorskip("torch")
    from speculators_compat.engine import arena as wk
    from speculators_compat.engine import handoff

    arena = wk.Arena(str(tmp_path / "arena-"), pin=False)
    arena.prepare(arena_bytes)
    reader = handoff.ArenaReader(threads=1, lend=True)
    g = torch.Generator().manual_seed(11)
    items = []
    for i in range(n):
        r = rows[i % len(rows)]
        layers = []
        for _ in range(3):
            b, off = arena.alloc(r * hidden * 2)
            arena.view(b, off, r, hidden, torch.bfloat16).copy_(torch.randn(r, hidden, generator=g))
            layers.append(reader.assemble([(arena.path(b), off, r)], hidden, torch.bfloat16))
        items.append(
            (
                i,
                {
                    "input_ids": torch.arange(r) + i,
                    "hidden_states": layers,
                    "loss_mask": torch.ones(r, dtype=torch.long),
                },
            )
        )
    return arena, reader, items


def _write_with_both(tmp_path, items, reader, fmt="pt", split=3, workers=2):
    """Write ``items`` (two batches, split at ``split``) with the thread writer and with the process
    writer; returns, per writer, its data files' bytes, its sorted checksums and the writer."""
    import json

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
        sums = sorted(json.loads(x)["crc32"] for x in (tmp_path / kind / "checksums.jsonl").read_text().splitlines())
        got[kind] = (files, sums, bw)
    return got


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_process_writer_writes_the_bytes_the_thread_writer_writes(tmp_path, fmt):
    arena, reader, items = _lent_samples(tmp_path)
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
    arena, reader, items = _lent_samples(tmp_path)
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

    arena, reader, items = _lent_samples(tmp_path)
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

    arena, reader, items = _lent_samples(tmp_path)
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
    arena, reader, items = _lent_samples(tmp_path, n=12, rows=(4096, 3000), hidden=8, arena_bytes=1 << 22)
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

    from speculators_compat.pipeline.output.files import write_sample

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


def _independent_digest(algo, data):
    import hashlib
    import zlib

    return hashlib.sha256(data).hexdigest() if algo == "sha256" else f"{zlib.crc32(data):08x}"


@pytest.mark.parametrize("kind", ["thread", "process"])
@pytest.mark.parametrize("checksum", ["sha256", "crc32", "none"])
def test_each_file_is_listed_with_the_chosen_checksum(tmp_path, kind, checksum, monkeypatch):
    """checksums.jsonl and manifest.json carry the chosen algorithm's digest of each file's bytes,
    keyed by its name, and no other; 'none' lists sizes only. Streamed and in-memory writes both."""
    import json

    from speculators_compat.pipeline.output import files
    from speculators_compat.pipeline.writers import processes as w
    from speculators_compat.pipeline.writers.threads import BackgroundWriter

    monkeypatch.setattr(files, "SMALL_SAMPLE_BYTES", 64 * 2 * 3 * 8)  # some samples stream, some do not
    arena, reader, items = _lent_samples(tmp_path)
    out = OutputDir(tmp_path / "out", "pt", checksum)
    out.prepare({"m": 1})
    bw = (
        w.ProcessWriter(out, reader.describe, queue_size=1, processes=2)
        if kind == "process"
        else BackgroundWriter(out, queue_size=1, threads=2)
    )
    bw.put(items[:3])
    bw.put(items[3:])
    bw.close()
    recs = [json.loads(x) for x in (tmp_path / "out" / "checksums.jsonl").read_text().splitlines()]
    manifest = out.finalize(len(items), {})
    assert manifest["checksum"] == checksum
    for r in recs + manifest["files"]:
        data = (tmp_path / "out" / r["file"]).read_bytes()
        assert r["bytes"] == len(data)
        others = {"sha256", "crc32"} - {checksum}
        assert not others & set(r), r
        if checksum == "none":
            assert "none" not in r
        else:
            assert r[checksum] == _independent_digest(checksum, data)
    assert sorted(r["index"] for r in recs) == list(range(len(items)))


def test_manifest_rehashes_files_listed_with_another_checksum(tmp_path):
    """A resumed run with another --checksum: the manifest lists every file with the new algorithm
    (files of the earlier run are rehashed), never a mix."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    sample = {"input_ids": torch.arange(5), "hidden_states": [torch.randn(5, 8)], "loss_mask": torch.ones(5)}
    for checksum, idx in [("sha256", [0, 1]), ("crc32", [2])]:
        out = OutputDir(tmp_path, "pt", checksum)
        out.prepare({"m": 1})
        bw = w.BackgroundWriter(out, queue_size=1, threads=1)
        bw.put([(i, sample) for i in idx])
        bw.close()
    manifest = out.finalize(3, {})
    assert manifest["checksum"] == "crc32" and manifest["num_files"] == 3
    for r in manifest["files"]:
        assert "sha256" not in r
        assert r["crc32"] == _independent_digest("crc32", (tmp_path / r["file"]).read_bytes())


def test_unknown_checksum_is_refused_before_anything_starts(tmp_path):
    from speculators_compat.cli import build_parser
    from speculators_compat.pipeline.extract import run_extract

    with pytest.raises(ValueError, match="checksum must be one of crc32, sha256, none, not 'md5'"):
        OutputDir(tmp_path, "pt", "md5")
    # refused before the input is read or an engine starts (neither exists here)
    with pytest.raises(ValueError, match="'md5'"):
        run_extract(str(tmp_path / "no-model"), str(tmp_path / "no-input.jsonl"), str(tmp_path / "o"), checksum="md5")
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "--model", "m", "--input", "i", "--output", "o", "--checksum", "md5"])


@pytest.mark.parametrize("name", ["md5", None])
def test_a_digest_needs_a_chosen_algorithm(name):
    """None means "choose later" only before the run; a digest asked for None is a bug and must
    not silently become no checksum."""
    from speculators_compat.pipeline.output.checksums import new_digest

    with pytest.raises(ValueError, match=f"checksum must be one of crc32, sha256, none, not {name!r}"):
        new_digest(name)
    assert new_digest("none").hexdigest() is None and len(new_digest("crc32", b"x").hexdigest()) == 8


def test_a_rerun_keeps_the_checksum_it_finds_unless_told(tmp_path):
    """No --checksum: a new output gets crc32; a rerun into an output made with sha256 keeps sha256
    (no rehash of a large dataset because a default changed)."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    sample = {"input_ids": torch.arange(4), "hidden_states": [torch.randn(4, 8)], "loss_mask": torch.ones(4)}
    assert OutputDir(tmp_path / "new").checksum is None
    fresh = OutputDir(tmp_path / "new")
    fresh.prepare({"m": 1})
    assert fresh.checksum == "crc32"
    old = OutputDir(tmp_path / "old", "pt", "sha256")
    old.prepare({"m": 1})
    bw = w.BackgroundWriter(old, queue_size=1, threads=1)
    bw.put([(0, sample)])
    bw.close()
    again = OutputDir(tmp_path / "old")
    again.prepare({"m": 1})
    assert again.checksum == "sha256"
    bw = w.BackgroundWriter(again, queue_size=1, threads=1)
    bw.put([(1, sample)])
    bw.close()
    manifest = again.finalize(2, {})
    assert manifest["checksum"] == "sha256"
    assert all(
        r["sha256"] == _independent_digest("sha256", (tmp_path / "old" / r["file"]).read_bytes())
        for r in manifest["files"]
    )


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_verify_finds_every_kind_of_damage(tmp_path, checksum, capsys):
    """`speculators-compat verify`: a clean output passes; a flipped byte (same size), a truncated
    file, a deleted file and an unlisted data file are each named, and the exit code is 1."""
    torch = pytest.importorskip("torch")
    from speculators_compat.cli import main
    from speculators_compat.pipeline.writers import threads as w

    out = OutputDir(tmp_path, "pt", checksum)
    out.prepare({"m": 1})
    bw = w.BackgroundWriter(out, queue_size=1, threads=2)
    bw.put(
        [
            (i, {"input_ids": torch.arange(6), "hidden_states": [torch.randn(6, 16)], "loss_mask": torch.ones(6)})
            for i in range(5)
        ]
    )
    bw.close()
    # before the manifest (checksums.jsonl): intact, but the run has not finished
    assert main(["verify", str(tmp_path)]) == 3
    assert "INCOMPLETE" in capsys.readouterr().out
    out.finalize(5, {})
    assert main(["verify", str(tmp_path)]) == 0
    assert "OK: 5 files checked against manifest.json" in capsys.readouterr().out
    b = bytearray((tmp_path / "data_1.pt").read_bytes())
    b[-100] ^= 0xFF
    (tmp_path / "data_1.pt").write_bytes(bytes(b))
    (tmp_path / "data_2.pt").write_bytes(b[:50])
    (tmp_path / "data_3.pt").unlink()
    (tmp_path / "data_9.pt").write_bytes(b"x")
    assert main(["verify", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert f"data_1.pt: {checksum} differs" in text
    assert "data_2.pt: 50 bytes, listed as" in text
    assert "data_3.pt: missing" in text
    assert "data_9.pt: on disk but not listed" in text
    assert "data_0.pt" not in text and "data_4.pt" not in text
    assert main(["verify", str(tmp_path / "nope")]) == 2  # a clear error, not a traceback
    assert "no output directory" in capsys.readouterr().err


def test_a_non_utf8_line_is_named(tmp_path):
    """The JSONL is decoded line by line: a bad byte names its line (not the read block's first)."""
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"input_ids": [1]}\n{"input_ids": [2]}\n{"input_ids": [3], "x": "\xff"}\n')
    it = open_dataset(f)
    assert [next(it).input_ids, next(it).input_ids] == [[1], [2]]  # what precedes it is read
    with pytest.raises(DatasetError, match=r"d.jsonl:3: not UTF-8 text \(invalid start byte at column 26\)"):
        next(it)


def test_waiting_for_writer_processes_to_start_is_not_counted_as_a_slow_disk(tmp_path):
    """A fresh writer process spends 1-3 s importing torch before it reads a task. A run that
    fills its queue meanwhile waits for the start-up, not for the disk: that time goes to
    start_wait_s, and wait_s (what the write-bound warning reads) holds only the rest. Before,
    all of it was wait_s, and a short run on a GPU host with a new pool warned that its disk
    was slow (seen on the H200: "waited 2.8 s of 4.8 s", writing to a disk that keeps 1.2 GiB/s)."""
    import time

    from speculators_compat.pipeline.writers import processes as w

    arena, reader, items = _lent_samples(tmp_path)
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


def test_file_names_of_each_format():
    from speculators_compat.pipeline.output.files import data_file_index, file_name

    assert [file_name(7, f) for f in ("pt", "safetensors", "speculators-hs")] == [
        "data_7.pt",
        "data_7.safetensors",
        "hs_7.safetensors",
    ]
    assert data_file_index("hs_12.safetensors") == 12 and data_file_index("data_3.pt") == 3
    assert data_file_index("hs_12.safetensors", "speculators-hs") == 12
    assert data_file_index("hs_12.safetensors", "safetensors") is None  # (another format's file)
    assert data_file_index("data_3.pt", "speculators-hs") is None
    for other in ("hs_1.pt", ".hs_1.safetensors.partial", "hs_x.safetensors", "sample_lengths.json"):
        assert data_file_index(other) is None, other


def test_speculators_hs_refusals_before_any_engine(tmp_path):
    from speculators_compat.pipeline.extract import run_extract

    src = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [5, 6, 7]}])
    with pytest.raises(ValueError, match="on-overlength skip would leave a dataset row"):
        run_extract("/nonexistent", str(src), str(tmp_path / "o"), fmt="speculators-hs", on_overlength="skip")
    d = tmp_path / "prepared"
    d.mkdir()
    with pytest.raises(ValueError, match="is the input dataset"):
        run_extract("/nonexistent", str(d), str(d), fmt="speculators-hs")
    assert not (tmp_path / "o").exists()


def _five_files(tmp_path):
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    out = OutputDir(tmp_path, "pt")
    out.prepare({"m": 1, "samples": 8})
    bw = w.BackgroundWriter(out, queue_size=1, threads=1)
    sample = {"input_ids": torch.arange(6), "hidden_states": [torch.randn(6, 16)], "loss_mask": torch.ones(6)}
    bw.put([(i, sample) for i in range(5)])
    bw.close()
    return out


def test_verify_right_after_a_kill_says_incomplete_not_failed(tmp_path, capsys):
    """A run killed between a file's rename and its record leaves a whole file that checksums.jsonl
    does not list: that is a run that has not finished (the next one writes the file again), not
    damage. With a manifest, an unlisted file is still a problem."""
    from speculators_compat.cli import main

    _five_files(tmp_path)
    lines = (tmp_path / "checksums.jsonl").read_text().splitlines()
    (tmp_path / "checksums.jsonl").write_text("\n".join(lines[:4]) + "\n")  # data_4.pt's record never came
    assert main(["verify", str(tmp_path)]) == 3
    text = capsys.readouterr().out
    assert "NOTE data_4.pt: on disk but not yet in checksums.jsonl" in text
    assert "INCOMPLETE: 4 of 8 samples have no file yet (indices 4-7)" in text and "BAD" not in text


def test_a_torn_last_record_does_not_take_the_next_one_with_it(tmp_path):
    """A kill mid-append leaves a torn last line in checksums.jsonl. The resume cuts it off: the
    torn record's file is computed again, and the records appended after it are whole."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    _five_files(tmp_path)
    f = tmp_path / "checksums.jsonl"
    f.write_bytes(f.read_bytes()[:-20])  # data_4.pt's record torn
    again = OutputDir(tmp_path, "pt")
    done = again.prepare({"m": 1, "samples": 8})
    assert done == {0, 1, 2, 3}  # data_4.pt had no whole record: removed, to be written again
    assert f.read_bytes().endswith(b"\n")
    bw = w.BackgroundWriter(again, queue_size=1, threads=1)
    sample = {"input_ids": torch.arange(6), "hidden_states": [torch.randn(6, 16)], "loss_mask": torch.ones(6)}
    bw.put([(i, sample) for i in (4, 5)])
    bw.close()
    assert sorted(again.checksum_records()) == [0, 1, 2, 3, 4, 5]
    manifest = again.finalize(6, {})
    assert manifest["total_tokens"] == 36 and json.loads((tmp_path / "sample_lengths.json").read_text())["5"] == 6


def test_a_run_reading_fewer_samples_than_the_output_holds_is_refused(tmp_path):
    """--max-samples 3 over an output holding 5 files would write a manifest for 3 and leave 2 out."""
    out = _five_files(tmp_path)
    with pytest.raises(OutputError, match=r"holds files of 2 sample\(s\) at index 3 and above \(up to 4\)"):
        out.check_total(3)
    out.check_total(5)
    out.check_total(64)

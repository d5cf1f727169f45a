"""``speculators-compat extract`` end to end on the real engine: speculators' layout, HF-exact
states, resume to a byte-identical dataset, and a killed worker."""

import io
import json
import os
import time
from pathlib import Path

import pytest

from speculators_compat.errors import OutputError
from speculators_compat.pipeline.extract import run_extract
from speculators_compat.testing import models, reference
from tests.helpers import LENGTHS, make_jsonl, read_dir

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def gen(llama_path):
    from speculators_compat import VllmHiddenStatesGenerator

    g = VllmHiddenStatesGenerator(
        llama_path,
        layer_ids=LAYERS,
        max_model_len=2048,
        dtype="float32",
        max_num_batched_tokens=512,
        on_overlength="error",
    )
    yield g
    g.close()


def test_layout_states_and_speculators_loader(gen, llama_path, hf_ref, tmp_path):
    import torch

    rows = make_jsonl(tmp_path / "in.jsonl")
    out = tmp_path / "out"
    s = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), batch_size=5, generator=gen, progress=False)
    assert s["files"] == len(rows) and s["truncated"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_files"] == len(rows) and manifest["layer_ids"] == LAYERS
    ref = hf_ref(llama_path, LAYERS)
    for i, row in enumerate(rows):
        data = (out / f"data_{i}.pt").read_bytes()
        d = torch.load(io.BytesIO(data), weights_only=True)
        again = io.BytesIO()
        torch.save(d, again)  # the file is what torch.save writes for its own contents
        assert again.getvalue() == data, i
        ids = row["input_ids"][:2047]
        assert d["input_ids"].tolist() == ids
        want_mask = row.get("loss_mask", [1] * len(ids))[:2047]
        assert d["loss_mask"].tolist() == want_mask
        worst, bad = reference.compare([d["hidden_states"]], [ids], ref, reference.TOLERANCE["float32"])
        assert not bad, (i, worst)
        assert manifest["files"][i]["file"] == f"data_{i}.pt"
    try:
        from speculators.train.data import Eagle3SampleFileDataset
    except Exception as e:  # transformers 5 + no patch would fail here; the patch is active
        pytest.fail(f"speculators trainer data module not importable: {e}")
    ds = Eagle3SampleFileDataset(max_len=2048, datapath=str(out))
    item = ds[0]
    assert len(ds) == len(rows)
    assert item["hidden_states"].shape[-1] == 128 * (len(LAYERS) - 1)
    assert item["verifier_last_hidden_states"].shape[-1] == 128


def test_resume_is_byte_identical(gen, llama_path, tmp_path, monkeypatch):
    """The interrupted run writes its files by torch.save, the full run and the resume build them
    directly (SPECULATORS_COMPAT_PT_WRITER): the datasets must still be byte-identical."""
    make_jsonl(tmp_path / "in.jsonl", seed=1)
    full, part = tmp_path / "full", tmp_path / "part"
    run_extract(llama_path, str(tmp_path / "in.jsonl"), str(full), batch_size=4, generator=gen, progress=False)
    # an interrupted run: the first 6 samples (batch 2 half done), then a crash leftover
    monkeypatch.setenv("SPECULATORS_COMPAT_PT_WRITER", "torch")
    run_extract(
        llama_path, str(tmp_path / "in.jsonl"), str(part), batch_size=4, generator=gen, progress=False, max_samples=6
    )
    monkeypatch.setenv("SPECULATORS_COMPAT_PT_WRITER", "direct")
    (part / "data_5.pt").unlink()
    (part / ".data_5.pt.partial").write_bytes(b"torn")
    s = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(part), batch_size=4, generator=gen, progress=False)
    assert s["already_done"] == 5 and s["new_files"] == len(LENGTHS) - 5
    assert read_dir(part) == read_dir(full)


def test_a_failed_self_check_writes_nothing_of_its_batch(gen, llama_path, tmp_path, monkeypatch):
    """The pipeline checks by default, also with a generator that does not (this module's).
    The second batch runs with a fault in the worker's capture (two requests' rows swapped):
    the run stops with the self-check's CaptureError before that batch reaches the writer; the
    first batch's files are whole and recorded; a rerun completes the dataset, checked."""
    from speculators_compat.errors import CaptureError

    make_jsonl(tmp_path / "in.jsonl", lengths=[40] * 10, seed=3)
    out = tmp_path / "out"
    real, calls = gen.generate, []

    def generate(ids):
        calls.append(len(ids))
        fault = "swap" if len(calls) == 2 else None
        gen.engine.executor.collective_rpc("compat_inject_fault", args=(fault,))
        return real(ids)

    monkeypatch.setattr(gen, "generate", generate)
    try:
        with pytest.raises(CaptureError, match="self-check: 2 of 5 prompts"):
            run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), batch_size=5, generator=gen, progress=False)
    finally:
        gen.engine.executor.collective_rpc("compat_inject_fault", args=(None,))
        monkeypatch.undo()
    assert sorted(p.name for p in out.glob("data_*")) == [f"data_{i}.pt" for i in range(5)]
    assert not (out / "manifest.json").exists()
    records = [json.loads(x) for x in (out / "checksums.jsonl").read_text().splitlines()]
    assert sorted(r["file"] for r in records) == [f"data_{i}.pt" for i in range(5)]
    s = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), batch_size=5, generator=gen, progress=False)
    assert s["already_done"] == 5 and s["new_files"] == 5
    assert s["self_check"].pop("max_logprob_diff") < 1e-2
    assert s["self_check"] == {"checked": 5, "failed": 0, "near_ties": 0, "max_gap": 0.0, "values_checked": 5}
    assert not gen.engine.self_check  # on for the run (extract's default), the generator's own after
    assert json.loads((out / "runs.jsonl").read_text().splitlines()[-1])["self_check"]["values_checked"] == 5


def test_resume_with_a_lower_batch_size_completes_the_run(gen, llama_path, hf_ref, tmp_path):
    """A run stopped by a memory error is resumed with a lower --batch-size: the resume is taken
    (before, "holds a different run (batch_size: 8 -> 2)" and the files written were no use), it
    computes only what is missing, and every sample matches HF."""
    import torch

    rows = make_jsonl(tmp_path / "in.jsonl", seed=5)
    out = tmp_path / "out"
    run_extract(
        llama_path, str(tmp_path / "in.jsonl"), str(out), batch_size=8, generator=gen, progress=False, max_samples=8
    )
    s = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), batch_size=2, generator=gen, progress=False)
    assert s["already_done"] == 8 and s["new_files"] == len(rows) - 8 and s["batch_size"] == 2
    ref = hf_ref(llama_path, LAYERS)
    for i, row in enumerate(rows):
        d = torch.load(out / f"data_{i}.pt", weights_only=True)
        ids = row["input_ids"][:2047]
        assert d["input_ids"].tolist() == ids
        worst, bad = reference.compare([d["hidden_states"]], [ids], ref, reference.TOLERANCE["float32"])
        assert not bad, (i, worst)
    assert json.loads((out / "manifest.json").read_text())["num_files"] == len(rows)


@pytest.mark.ends
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_process_writer_gives_the_same_dataset(gen, llama_path, tmp_path, fmt):
    """--writer process (the default on GPU hosts): lent rows travel to writer processes as
    (arena file, offset, rows); rows that are not lent would be written on a local thread
    (tested in test_pipeline_unit). The dataset must be byte-identical to the thread writer's,
    and a resume across the two writers must be too. max_num_batched_tokens=512 splits the long
    prompts over steps: they are lent as one block too."""
    make_jsonl(tmp_path / "in.jsonl", seed=3)
    threads, procs, mixed = tmp_path / "threads", tmp_path / "procs", tmp_path / "mixed"
    kw = dict(batch_size=4, generator=gen, progress=False, fmt=fmt)
    from speculators_compat.pipeline.writers.processes import shutdown_writer_pool

    a = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(threads), writer="thread", **kw)
    shutdown_writer_pool()  # new processes: the run's first batches wait for them to start
    b = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(procs), writer="process", writer_threads=2, **kw)
    assert a["writer"] == "thread" and b["writer"] == "process"
    # that start-up (their torch import) is reported apart and is no sign of a slow disk
    assert b["writer_start_s"] > 0 and not b["write_bound"] and a["writer_start_s"] == 0
    # every sample, also those split over engine steps, is one lent block: all go to the processes
    assert b["files_by_writer_processes"] == len(LENGTHS)
    assert read_dir(procs) == read_dir(threads)
    run_extract(llama_path, str(tmp_path / "in.jsonl"), str(mixed), writer="thread", max_samples=6, **kw)
    run_extract(llama_path, str(tmp_path / "in.jsonl"), str(mixed), writer="process", **kw)
    assert read_dir(mixed) == read_dir(threads)
    # every written sample gives its rows back (torch.save in torch 2.8-2.9 leaves a garbage
    # cycle holding what it saved, which may reach the oldest GC generation: write_sample saves
    # aliases; this failed on CI, on vLLM 0.12 / torch 2.9.1, before that)
    assert gen.engine._reader.busy() == []


def test_pipeline_makes_its_arena_slabs_at_the_first_batch(gen, llama_path, tmp_path):
    """The pipeline holds up to queue_size + 1 batches of lent rows in its writer while the engine
    fills the next. It says so, and the worker makes those queue_size + 2 slabs at the first batch,
    instead of one at a time mid-run whenever the writers fall further behind (on a GPU each is
    page-locked: ~0.3 s of engine time). Afterwards plain calls make slabs as needed again."""
    if not gen.engine.lends_rows:
        pytest.skip("rows are copied out (SPECULATORS_COMPAT_ZERO_COPY=0): nothing is held")
    make_jsonl(tmp_path / "in.jsonl", lengths=[30] * 24)  # 6 batches of 4
    after_first = []

    class Watch:  # the generator, noting the worker's arena after its first batch
        def __getattr__(self, name):
            return getattr(gen, name)

        def generate(self, ids):
            out = gen.generate(ids)
            if not after_first:
                after_first.append(gen.engine.stats())
            return out

    s = run_extract(
        llama_path,
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "out"),
        batch_size=4,
        queue_size=4,
        generator=Watch(),
        progress=False,
    )
    assert s["files"] == 24
    # 6 = queue_size + 2: more than any earlier test here leaves in the arena (queue_size 2: 4)
    assert after_first[0]["arena_want"] == 6 and after_first[0]["arena_slabs"] >= 6
    assert gen.engine.arena_slabs == 0
    gen.generate([[1, 2, 3]])  # the next call tells the worker
    assert gen.engine.stats()["arena_want"] == 0


def test_safetensors_output(gen, llama_path, tmp_path):
    from safetensors.torch import load_file

    rows = make_jsonl(tmp_path / "in.jsonl", lengths=[12, 40, 7])
    s = run_extract(
        Path(llama_path),
        tmp_path / "in.jsonl",
        tmp_path / "st",  # (paths as Path objects too)
        generator=gen,
        progress=False,
        fmt="safetensors",
    )
    assert s["files"] == 3
    d = load_file(str(tmp_path / "st" / "data_1.safetensors"))
    assert d["input_ids"].tolist() == rows[1]["input_ids"]
    assert [tuple(d[f"hidden_states_{j}"].shape) for j in range(3)] == [(40, 128)] * 3


@pytest.mark.ends
def test_sharded_safetensors_match_the_per_sample_files_and_resume(gen, llama_path, hf_ref, tmp_path):
    """--format safetensors --shard-size 4 with batches of 3 (shards and batches do not line up):
    each sample's tensors equal the data_{i}.pt of a per-sample run on the same engine, its states
    match HF, and a run cut short by --max-samples (its last shard short) resumes to the same bytes."""
    import torch

    from speculators_compat.pipeline.output.verify import verify_output
    from speculators_compat.pipeline.writers.shards import load_shard

    rows = make_jsonl(tmp_path / "in.jsonl", seed=5)
    inp = str(tmp_path / "in.jsonl")
    kw = dict(batch_size=3, generator=gen, progress=False)
    run_extract(llama_path, inp, str(tmp_path / "pt"), **kw)
    s = run_extract(llama_path, inp, str(tmp_path / "sh"), fmt="safetensors", shard_size=4, **kw)
    assert s["files"] == 4 and s["shard_size"] == 4 and s["writer"] == "thread"
    got = {x["index"]: x for k in range(4) for x in load_shard(tmp_path / "sh" / f"shard_{k}.safetensors")}
    assert sorted(got) == list(range(len(rows)))
    ref = hf_ref(llama_path, LAYERS)
    for i, row in enumerate(rows):
        d = torch.load(tmp_path / "pt" / f"data_{i}.pt", weights_only=True)
        assert torch.equal(got[i]["input_ids"], d["input_ids"]) and torch.equal(got[i]["loss_mask"], d["loss_mask"])
        assert all(torch.equal(a, b) for a, b in zip(got[i]["hidden_states"], d["hidden_states"], strict=True))
        worst, bad = reference.compare(
            [got[i]["hidden_states"]], [row["input_ids"][:2047]], ref, reference.TOLERANCE["float32"]
        )
        assert not bad, (i, worst)
    assert verify_output(tmp_path / "sh")["ok"]
    part = tmp_path / "part"
    run_extract(llama_path, inp, str(part), fmt="safetensors", shard_size=4, max_samples=6, **kw)
    r = run_extract(llama_path, inp, str(part), fmt="safetensors", shard_size=4, **kw)
    assert r["already_done"] == 4  # shard 0: batch 0-2 skipped; 3-5 computed again, for 4 and 5 only
    names = sorted(p.name for p in (tmp_path / "sh").iterdir() if p.name.startswith("shard_")) + ["manifest.json"]
    assert names == sorted(p.name for p in part.iterdir() if p.name.startswith("shard_")) + ["manifest.json"]
    for n in names:
        assert (part / n).read_bytes() == (tmp_path / "sh" / n).read_bytes(), n
    assert gen.engine._reader.busy() == []  # the shard writer copied its rows and let them go


def test_bad_pipeline_inputs(gen, llama_path, tmp_path):
    from speculators_compat.pipeline.dataset import DatasetError

    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, \n')
    with pytest.raises(DatasetError, match="bad.jsonl:2: malformed JSON"):
        run_extract(
            llama_path, str(tmp_path / "bad.jsonl"), str(tmp_path / "o1"), generator=gen, progress=False, batch_size=1
        )
    # the whole input is checked before the first batch is computed (it was found only when the
    # reader got to line 2, after sample 0 was computed and written)
    assert not list((tmp_path / "o1").glob("data_*"))
    make_jsonl(tmp_path / "in.jsonl")
    with pytest.raises(DatasetError, match="sample 12 has 2100 tokens"):
        run_extract(
            llama_path,
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "o2"),
            generator=gen,
            progress=False,
            on_overlength="error",
        )
    s = run_extract(
        llama_path,
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "o3"),
        generator=gen,
        progress=False,
        on_overlength="skip",
    )
    assert s["skipped_overlength"] == 1 and not (tmp_path / "o3" / "data_12.pt").exists()
    # a token id outside the vocabulary: the sample (not its place in the batch) is named, before
    # the first batch (config.json's vocab_size)
    rows = [{"input_ids": [1, 2, 3]}] * 5 + [{"input_ids": [4, models.VOCAB + 9]}]
    (tmp_path / "vocab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DatasetError,
        match=f"sample 5 holds token id {models.VOCAB + 9}, outside the model's vocabulary of {models.VOCAB} ids",
    ):
        run_extract(
            llama_path, str(tmp_path / "vocab.jsonl"), str(tmp_path / "o4"), generator=gen, progress=False, batch_size=4
        )
    assert sorted(p.name for p in (tmp_path / "o4").glob("data_*.pt")) == []


@pytest.mark.ends
def test_a_run_bound_by_its_disk_says_so(gen, llama_path, tmp_path, monkeypatch, caplog):
    """A disk slower than the engine is a seam no CPU test machine reaches on demand, so a sleep
    in front of each file's real write stands in for it (the engine, the files and the queue are
    real). The run must say it was write-bound and report what it wrote; a run on this machine's
    own disk with tiny files must not."""
    import logging

    from speculators_compat.pipeline.writers import threads as w

    make_jsonl(tmp_path / "in.jsonl", lengths=[16] * 12, seed=4)
    kw = dict(batch_size=2, generator=gen, progress=False, writer="thread", writer_threads=1, queue_size=1)
    fast = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(tmp_path / "fast"), **kw)
    assert fast["write_bound"] is False and fast["writer_wait_s"] < 1.0
    real = w.write_sample

    def slow_disk(*a, **k):
        time.sleep(0.25)
        return real(*a, **k)

    monkeypatch.setattr(w, "write_sample", slow_disk)
    with caplog.at_level(logging.WARNING, logger="speculators_compat.pipeline"):
        s = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(tmp_path / "slow"), **kw)
    assert s["write_bound"] is True and s["writer_wait_s"] >= 1.0
    assert "bound by writing its output" in caplog.text and str(tmp_path / "slow") in caplog.text
    files = list((tmp_path / "slow").glob("data_*.pt"))
    assert len(files) == 12 and s["bytes_written"] == sum(f.stat().st_size for f in files)
    assert 0 < s["write_mib_per_s"] < s["bytes_written"] / 2**20 / 2.5  # 12 files at >= 0.25 s each
    assert read_dir(tmp_path / "slow") == read_dir(tmp_path / "fast")  # slow, but the same data
    # the run record's account of where the bytes' time went (files/stages.py)
    st = fast["stages"]
    assert st["files"] == 12 and st["bytes"] == fast["bytes_written"]
    gb = st["bytes"] / 1e9
    for name in ("encode", "checksum", "write", "sync", "rename", "record", "engine", "final_sync"):
        # (s_per_gb is computed before "s" is rounded to 0.1 ms)
        assert st[name]["s"] >= 0 and st[name]["s_per_gb"] == pytest.approx(st[name]["s"] / gb, abs=0.6e-4 / gb), name
    assert st["engine"]["s"] > 0 and st["write"]["s"] > 0


def _flip_a_bit(p: Path, keep_mtime: bool = False) -> None:
    st = p.stat()
    b = bytearray(p.read_bytes())
    b[-200] ^= 0x01
    p.write_bytes(bytes(b))
    if keep_mtime:  # (as a copy that keeps times, or bit rot, would)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_resume_over_a_changed_input_is_refused(gen, llama_path, tmp_path):
    """The same path, the same sample count, other contents (preprocessing run again into the
    same file): the resume used to take it (already_done 6, 8 new files from the new contents, and
    verify said OK). It is refused, naming the input, and nothing on disk changes. The same input
    under another path is the same input: that resume is taken."""
    import shutil

    make_jsonl(tmp_path / "in.jsonl", seed=1)
    shutil.copy(tmp_path / "in.jsonl", tmp_path / "same.jsonl")
    out = tmp_path / "out"
    run_extract(
        llama_path, str(tmp_path / "in.jsonl"), str(out), batch_size=4, generator=gen, progress=False, max_samples=6
    )
    before = read_dir(out)
    make_jsonl(tmp_path / "in.jsonl", seed=2)
    with pytest.raises(
        OutputError,
        match=r"holds a different run \(input .*in.jsonl: the input's (contents|size) "
        r"changed .*resuming would mix states of two runs",
    ):
        run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), batch_size=4, generator=gen, progress=False)
    assert read_dir(out) == before
    s = run_extract(llama_path, str(tmp_path / "same.jsonl"), str(out), batch_size=4, generator=gen, progress=False)
    assert s["already_done"] == 6 and s["new_files"] == len(LENGTHS) - 6


def test_a_resume_over_changed_weights_is_refused(gen, llama_path, tmp_path):
    """The model's weights replaced under the same path with tensors of the same names and shapes
    (a retrained checkpoint): refused, naming the weight file."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    make_jsonl(tmp_path / "in.jsonl", seed=1)
    out = tmp_path / "out"
    run_extract(
        str(model), str(tmp_path / "in.jsonl"), str(out), batch_size=4, generator=gen, progress=False, max_samples=4
    )
    w = load_file(str(model / "model.safetensors"))
    name = sorted(w)[0]
    w[name] = w[name] * 1.01
    save_file(w, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(OutputError, match=r"model .*: weight file model.safetensors holds other values"):
        run_extract(str(model), str(tmp_path / "in.jsonl"), str(out), batch_size=4, generator=gen, progress=False)
    assert len(list(out.glob("data_*.pt"))) == 4


def test_a_damaged_file_is_computed_again(gen, llama_path, tmp_path, caplog):
    """A bit flipped in data_5.pt (same size) counted as done and stayed: only verify noticed. Now
    a resume checks each kept file's size and write time against its record, and the checksum of a
    changed one, of those an unfinished run wrote last, and with verify_existing of all; a bad file
    is said and computed again, to the bytes of the original."""
    import logging

    make_jsonl(tmp_path / "in.jsonl", seed=1)
    out = tmp_path / "out"
    kw = dict(batch_size=4, generator=gen, progress=False)
    run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), **kw)
    good = read_dir(out)
    _flip_a_bit(out / "data_5.pt")
    (out / "data_9.pt").write_bytes(good["data_9.pt"][:-10])
    with caplog.at_level(logging.WARNING, logger="speculators_compat.pipeline"):
        s = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), **kw)
    assert s["new_files"] == 2, s
    assert (
        "data_5.pt: its crc32 differs from the one recorded when it was written (the file was modified since)"
        in caplog.text
    )
    assert (
        f"data_9.pt: {len(good['data_9.pt']) - 10:,} bytes where {len(good['data_9.pt']):,} were written" in caplog.text
    )
    assert read_dir(out) == good
    # the same size and write time: a finished run's files are trusted, unless every file is checked
    _flip_a_bit(out / "data_2.pt", keep_mtime=True)
    assert run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), **kw)["new_files"] == 0
    assert run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), verify_existing=True, **kw)["new_files"] == 1
    assert read_dir(out) == good
    # an unfinished run's files are durable before they are recorded ("durable": true): a crash
    # cannot have torn one, so they are trusted like a finished run's ...
    sums = out / "checksums.jsonl"
    lines = sums.read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["durable"] is True
    _flip_a_bit(out / last["file"], keep_mtime=True)
    (out / "manifest.json").unlink()
    assert run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), **kw)["new_files"] == 0
    # ... but the last files of a run whose writer did not sync them (no "durable") are checked
    lines = sums.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    recs[-1].pop("durable")  # (the file's newest record: the one a resume reads)
    sums.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (out / "manifest.json").unlink()
    assert run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), **kw)["new_files"] == 1
    assert read_dir(out) == good


def test_truncation_is_said_naming_the_samples(gen, llama_path, tmp_path, caplog):
    import logging

    make_jsonl(tmp_path / "in.jsonl")
    with caplog.at_level(logging.WARNING, logger="speculators_compat.pipeline"):
        s = run_extract(
            llama_path, str(tmp_path / "in.jsonl"), str(tmp_path / "out"), batch_size=7, generator=gen, progress=False
        )
    assert s["truncated"] == 1
    assert (
        "1 sample(s) longer than max_model_len - 1 = 2047 tokens will be truncated to that length: "
        "sample 12 (2,100 tokens)"
    ) in caplog.text


def test_verify_says_an_unfinished_run_is_incomplete(gen, llama_path, tmp_path, capsys):
    """A run that stopped part-way (here after its first batch): verify said OK; it says
    INCOMPLETE, with how many samples are missing, and exits 3."""
    from speculators_compat.cli import main

    class StopAfterFirstBatch(_RewriteAfter):
        def update(self, k):
            raise RuntimeError("stopped")

    rows = [{"input_ids": [1, 2, 3]}] * 5 + [{"input_ids": [4, 9]}] + [{"input_ids": [7, 8]}] * 3
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RuntimeError, match="stopped"):
        run_extract(
            llama_path,
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "out"),
            generator=gen,
            progress=StopAfterFirstBatch(tmp_path / "in.jsonl", 0),
            batch_size=4,
        )
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out")]) == 3
    said = capsys.readouterr().out
    assert "INCOMPLETE: 5 of 9 samples have no file yet (indices 4-8); the run has not finished" in said, said


class _RewriteAfter:
    """A progress bar (run_extract's ``progress`` callable) that rewrites the input in place, same
    layout and length, once ``n`` samples are done: what a user regenerating the file does."""

    def __init__(self, path: Path, n: int):
        self.path, self.n, self.done = path, n, 0

    def __call__(self, total):
        return self

    def update(self, k):
        self.done += k
        if self.done >= self.n and self.n:
            rows = [json.loads(x) for x in self.path.read_text().splitlines()]
            for r in rows:
                r["input_ids"] = [5 + (t % 7) for t in r["input_ids"]]
            with open(self.path, "w") as f:  # (in place: the same inode, a new time)
                f.write("".join(json.dumps(r) + "\n" for r in rows))
            self.n = 0

    def set_postfix_str(self, *a, **k):
        pass

    def close(self):
        pass


def test_an_input_rewritten_during_the_run_stops_it(gen, llama_path, tmp_path):
    """The input is fingerprinted before the run; a rewrite while the run reads it stops the run at
    the next batch, with no manifest, and the rerun into the same output is refused by name."""
    from speculators_compat.errors import DatasetError, OutputError
    from speculators_compat.pipeline.extract import run_extract

    inp = tmp_path / "in.jsonl"
    make_jsonl(inp, lengths=[40] * 12, seed=9)
    out = tmp_path / "out"
    with pytest.raises(DatasetError, match=r"in.jsonl' changed while this run read it \(in.jsonl\): stopped"):
        run_extract(llama_path, str(inp), str(out), batch_size=2, generator=gen, progress=_RewriteAfter(inp, 4))
    assert not (out / "manifest.json").exists()
    assert len(list(out.glob("data_*.pt"))) <= 4  # the batches read before the change, at most
    with pytest.raises(OutputError, match=r"holds a different run \(input .*in.jsonl: the input.s size changed"):
        run_extract(llama_path, str(inp), str(out), batch_size=2, generator=gen, progress=False)


def test_a_rerun_with_nothing_to_do_keeps_the_manifest(gen, llama_path, tmp_path, capsys):
    """A no-op rerun and `verify --finalize` write the manifest an uninterrupted run wrote (its
    hidden_size too); a smaller --max-samples over the finished output is refused and changes nothing."""
    from speculators_compat.cli import main
    from speculators_compat.errors import OutputError
    from speculators_compat.pipeline.extract import run_extract

    make_jsonl(tmp_path / "in.jsonl", lengths=[30] * 6, seed=4)
    out = tmp_path / "out"
    args = (llama_path, str(tmp_path / "in.jsonl"), str(out))
    run_extract(*args, batch_size=2, generator=gen, progress=False)
    first = json.loads((out / "manifest.json").read_text())
    assert first["hidden_size"] == 128
    s = run_extract(*args, batch_size=2, generator=gen, progress=False)
    assert s["computed"] == 0
    again = json.loads((out / "manifest.json").read_text())
    assert {k: v for k, v in again.items() if k != "versions"} == {k: v for k, v in first.items() if k != "versions"}
    (out / "manifest.json").unlink()
    assert main(["verify", str(out), "--finalize"]) == 0
    assert json.loads((out / "manifest.json").read_text())["hidden_size"] == 128
    lengths = (out / "sample_lengths.json").read_text()
    with pytest.raises(OutputError, match=r"holds files of 2 sample\(s\) at index 4 and above"):
        run_extract(*args, batch_size=2, generator=gen, progress=False, max_samples=4)
    assert json.loads((out / "manifest.json").read_text())["num_files"] == 6
    assert (out / "sample_lengths.json").read_text() == lengths


def test_a_full_disk_stops_the_run_saying_what_is_needed_and_the_rerun_resumes(
    gen, llama_path, tmp_path, small_disk, monkeypatch
):
    """A real full disk (a small tmpfs), filled by a ballast file right after the run's own
    free-space check passed: the run stops with the bytes still needed against the plan's, every
    file it recorded is whole, and once space is freed the same command finishes the dataset,
    byte for byte the dataset of a run that never ran out."""
    from speculators_compat.pipeline import extract as ex

    make_jsonl(tmp_path / "in.jsonl", lengths=[64] * 12, seed=5)
    kw = dict(batch_size=2, generator=gen, progress=False)
    run_extract(llama_path, str(tmp_path / "in.jsonl"), str(tmp_path / "ref"), **kw)
    ref = read_dir(tmp_path / "ref")
    file_bytes = max(len(v) for k, v in ref.items() if k.startswith("data_"))
    disk = small_disk("8m")
    ballast = disk / "ballast"
    real = ex.check_free_space

    def then_fill(root, *a, **k):
        planned = real(root, *a, **k)
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        ballast.write_bytes(b"\0" * int(free - 3.5 * file_bytes))  # room for about 3 files
        return planned

    monkeypatch.setattr(ex, "check_free_space", then_fill)
    out = disk / "out"
    with pytest.raises(OutputError, match=r"no space left on .*out: \d+\.\d GB more needed \(plan said \d+\.\d GB\)"):
        run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), **kw)
    recorded = [json.loads(x) for x in (out / "checksums.jsonl").read_text().splitlines()]
    assert 1 <= len(recorded) < 12
    for r in recorded:
        assert (out / r["file"]).read_bytes() == ref[r["file"]]
    monkeypatch.setattr(ex, "check_free_space", real)
    ballast.unlink()
    s = run_extract(llama_path, str(tmp_path / "in.jsonl"), str(out), **kw)
    assert s["new_files"] == 12 - len(recorded)
    assert read_dir(out) == ref

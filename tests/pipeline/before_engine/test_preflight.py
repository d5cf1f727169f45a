"""What ``extract`` checks before an engine starts: the output directory and its lock, the model's
files, the whole input. No torch or vLLM needed: the checkpoints here are written by hand in the
safetensors layout, and the engine's constructor is the seam: a test fails if it is reached."""

import json
import os
import struct
import subprocess
import sys
import time

import pytest

from speculators_compat.checkpoint import (
    CheckpointError,
    check_checkpoint,
    describe_model_change,
    fingerprint_checkpoint,
)
from speculators_compat.errors import OutputError
from speculators_compat.pipeline import extract
from speculators_compat.pipeline.dataset import DatasetError, describe_input_change, scan_input
from speculators_compat.pipeline.output.outdir import OutputDir


def safetensors_bytes(tensors: dict[str, bytes], shapes: dict[str, list[int]] | None = None) -> bytes:
    header, off = {}, 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": (shapes or {}).get(name, [len(data) // 4]),
            "data_offsets": [off, off + len(data)],
        }
        off += len(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def fake_model(d, weights: bytes | None = None, layers: int = 6):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "vocab_size": 1024}))
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(
        weights if weights is not None else safetensors_bytes({"a": bytes(range(256)) * 1024, "b": b"\x01" * 4096})
    )
    return d


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"input_ids": list(range(1, 4 + i))} for i in range(12)]


@pytest.fixture
def no_engine(monkeypatch):
    """The engine's constructor: reaching it fails the test (these checks come before it)."""
    from speculators_compat import generator

    def refuse(*a, **k):
        raise AssertionError("the engine was started before the checks")

    monkeypatch.setattr(generator.VllmHiddenStatesGenerator, "__init__", refuse)


def run(model, inp, out, **kw):
    return extract.run_extract(str(model), str(inp), str(out), progress=False, **kw)


def run_past_the_checks(model, inp, out, **kw):
    """Run until every check before the engine passed: the engine's constructor (no_engine), or
    in the light environment the torch import that comes just before it."""
    with pytest.raises((AssertionError, ImportError)) as e:
        run(model, inp, out, **kw)
    assert "the engine was started" in str(e.value) or "torch" in str(e.value), e.value


def test_a_malformed_line_deep_in_the_input_is_named_before_the_engine(tmp_path, no_engine):
    rows = [json.dumps(r) for r in ROWS * 4]
    rows[40] = '{"input_ids": [1, 2,'
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(DatasetError, match=r"in.jsonl:41: malformed JSON"):
        run(fake_model(tmp_path / "m"), tmp_path / "in.jsonl", tmp_path / "out")


@pytest.mark.parametrize("text,what", [("", "it is empty"), ("\n  \n\n", "only blank lines")])
def test_an_empty_input_is_an_error_naming_the_file(tmp_path, no_engine, text, what):
    (tmp_path / "in.jsonl").write_text(text)
    with pytest.raises(DatasetError, match=rf"in.jsonl' holds no samples \({what}\)"):
        run(fake_model(tmp_path / "m"), tmp_path / "in.jsonl", tmp_path / "out")


def test_an_overlong_sample_with_on_overlength_error_is_named_before_the_engine(tmp_path, no_engine):
    rows = ROWS + [{"input_ids": [5] * 3000}]
    with pytest.raises(DatasetError, match=r"sample 12 has 3000 tokens; at most max_model_len - 1 = 2047"):
        run(
            fake_model(tmp_path / "m"),
            jsonl(tmp_path / "in.jsonl", rows),
            tmp_path / "out",
            on_overlength="error",
            max_model_len=2048,
        )


def test_another_runs_output_is_refused_before_the_engine(tmp_path, no_engine):
    m = fake_model(tmp_path / "m")
    out = OutputDir(tmp_path / "out")
    out.prepare({"model": str(m), "layer_ids": [0, 1], "format": "pt"})
    (tmp_path / "out" / "data_0.pt").write_bytes(b"x")  # a sample written: a run to protect
    with pytest.raises(OutputError, match=r"holds a different run \(.*layer_ids: \[0, 1\] -> \[1, 3, 5\]"):
        run(m, jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out", layer_ids=[1, 3, 5])


def test_an_output_with_no_sample_written_takes_the_corrected_run(tmp_path, no_engine):
    """A run that failed at its start leaves run.json and no sample: the corrected command is no
    "different run" (it reaches the engine here, which is the seam)."""
    m = fake_model(tmp_path / "m")
    OutputDir(tmp_path / "out").prepare({"model": str(m), "layer_ids": [0, 1], "format": "pt", "dtype": "float32"})
    run_past_the_checks(m, jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out", layer_ids=[1, 3, 5], dtype="bfloat16")
    assert json.loads((tmp_path / "out" / "run.json").read_text())["layer_ids"] == [1, 3, 5]


def test_a_max_model_len_over_the_models_positions_is_refused_before_the_engine(tmp_path, no_engine):
    m = fake_model(tmp_path / "m")
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=4096)))
    with pytest.raises(CheckpointError, match=r"--max-model-len 8,192 is above the 4,096 positions the model takes"):
        run(m, jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out", max_model_len=8192)
    assert not (tmp_path / "out" / "run.json").exists()
    (m / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=4096, rope_scaling={"factor": 4.0})))
    run_past_the_checks(m, jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out", max_model_len=8192)


def test_a_token_id_outside_the_vocabulary_is_named_before_the_engine(tmp_path, no_engine):
    rows = [dict(r) for r in ROWS]
    rows[9] = {"input_ids": [5, 1024, 7]}  # fake_model's vocab_size is 1024
    with pytest.raises(DatasetError, match=r"sample 9 holds token id 1024, outside the model's vocabulary of 1024"):
        run(fake_model(tmp_path / "m"), jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out")
    assert not (tmp_path / "out" / "run.json").exists()


def test_a_resume_with_another_dtype_is_refused_before_the_engine(tmp_path, no_engine):
    m = fake_model(tmp_path / "m")
    inp = jsonl(tmp_path / "in.jsonl", ROWS)
    run_past_the_checks(m, inp, tmp_path / "out", dtype="float32")
    out = OutputDir(tmp_path / "out")
    out.confirm({"dtype": "float32"})  # (what the engine that started would have recorded)
    (tmp_path / "out" / "data_0.pt").write_bytes(b"x")
    with pytest.raises(OutputError, match=r"holds a different run \(dtype: 'float32' -> 'bfloat16'\)"):
        run(m, inp, tmp_path / "out", dtype="bfloat16")
    run_past_the_checks(m, inp, tmp_path / "out", dtype="float")  # (the same dtype, spelled as vLLM also takes it)


def test_a_hub_id_that_cannot_be_fetched_is_a_clear_error(tmp_path, no_engine, monkeypatch):
    """A hub id with the hub offline, or a mistyped local path that looks like one."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"model 'modles/llama' is no directory here, and as a hub id"):
        run("modles/llama", jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out")


def test_samples_without_a_loss_mask_are_said_once(tmp_path, no_engine, caplog):
    run_past_the_checks(fake_model(tmp_path / "m"), jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out")
    said = [r.getMessage() for r in caplog.records if "loss_mask" in r.getMessage()]
    assert said == ["12 of 12 sample(s) have no loss_mask: every token of those counts in training (all ones)"]


def test_a_directory_that_is_no_extract_output_is_refused(tmp_path, no_engine):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"is not empty \(notes.txt\) and holds no run.json"):
        run(fake_model(tmp_path / "m"), jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_an_output_that_cannot_be_created_is_refused_before_the_engine(tmp_path, no_engine):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot create output directory"):
        run(fake_model(tmp_path / "m"), jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "file" / "out")


def test_a_read_only_output_is_refused_before_the_engine(tmp_path, no_engine):
    """A read-only filesystem (root ignores permission bits, so a chmod proves nothing here)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.decode().strip()}")
    try:
        with pytest.raises(OutputError, match="Read-only file system"):
            run(fake_model(tmp_path / "m"), jsonl(tmp_path / "in.jsonl", ROWS), ro / "out")
    finally:
        subprocess.run(["umount", str(ro)])


def test_a_second_run_into_a_locked_output_is_refused_naming_the_first(tmp_path, no_engine):
    m, inp = fake_model(tmp_path / "m"), jsonl(tmp_path / "in.jsonl", ROWS)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; sys.path.insert(0, sys.argv[2]);"
                "from speculators_compat.pipeline.output.outdir import OutputDir;"
                "o = OutputDir(sys.argv[1]); o.lock(); print('locked', flush=True); time.sleep(60)"
            ),
            str(tmp_path / "out"),
            os.getcwd(),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputError, match=rf"being written by another extract \(pid {holder.pid} on "):
            run(m, inp, tmp_path / "out")
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock went with it
    o = OutputDir(tmp_path / "out")
    o.lock()
    o.unlock()


def test_the_model_given_as_its_weight_file_is_named(tmp_path, no_engine):
    m = fake_model(tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"model.safetensors' is a file: the model is given as its directory"):
        run(m / "model.safetensors", jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out")


def test_a_truncated_weight_file_is_named_before_the_engine(tmp_path, no_engine):
    m = fake_model(tmp_path / "m")
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: [0-9,]+ bytes, but its header describes [0-9,]+ "
        r"\(truncated",
    ):
        run(m, jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out")


def test_checkpoint_checks(tmp_path):
    m = fake_model(tmp_path / "m")
    check_checkpoint(str(m))  # a good one passes
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_checkpoint(str(tmp_path / "missing"))
    (m / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        check_checkpoint(str(m))
    m = fake_model(tmp_path / "sharded")
    (m / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"lists 1 weight file\(s\) that are not in .*: model-00002-of-00002"):
        check_checkpoint(str(m))
    (m / "model-00002-of-00002.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: 2 bytes, too short"):
        check_checkpoint(str(m))
    (m / "model-00002-of-00002.safetensors").write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        check_checkpoint(str(m))
    check_checkpoint("org/model-on-a-hub")  # a hub id is the loader's business


def test_model_fingerprint_sees_new_values_behind_the_same_header(tmp_path):
    a = fingerprint_checkpoint(str(fake_model(tmp_path / "a")))
    assert describe_model_change(a, fingerprint_checkpoint(str(fake_model(tmp_path / "a2")))) == []  # other path
    same_shapes = safetensors_bytes({"a": bytes(range(255, -1, -1)) * 1024, "b": b"\x01" * 4096})
    b = fingerprint_checkpoint(str(fake_model(tmp_path / "b", same_shapes)))
    assert describe_model_change(a, b) == [
        "weight file model.safetensors holds other values (same tensors and size, different contents)"
    ]
    c = fingerprint_checkpoint(
        str(
            fake_model(
                tmp_path / "c",
                safetensors_bytes(  # a tensor renamed
                    {"c": bytes(range(256)) * 1024, "b": b"\x01" * 4096}
                ),
            )
        )
    )
    assert describe_model_change(a, c) == ["weight file model.safetensors holds other tensors (its header changed)"]
    (tmp_path / "c" / "config.json").write_text("{}")
    assert "config.json changed" in describe_model_change(a, fingerprint_checkpoint(str(tmp_path / "c")))


def many_tensors(scale: dict[int, int] | None = None) -> bytes:
    """64 tensors of 64 KiB (a 4 MiB weight file); ``scale``: tensor k's bytes multiplied by v (mod 256)."""
    t = {}
    for k in range(64):
        data = bytes((k * 7 + i) % 251 for i in range(256)) * 256
        if scale and k in scale:
            data = bytes((b * scale[k]) % 256 for b in data)
        t[f"layers.{k}.weight"] = data
    return safetensors_bytes(t)


def test_a_tensor_between_sampled_blocks_changed_is_seen(tmp_path, no_engine):
    """A merged LoRA changes a few whole tensors, same names, shapes and size. Tensors 2 and 40 lie
    between the 16 blocks of 64 KiB the fingerprint used to sample (at 0, 276 KiB, ..., 4 MiB):
    every tensor's start, middle and end are sampled now. The resume is refused before the engine."""
    m = fake_model(tmp_path / "m", many_tensors())
    a = fingerprint_checkpoint(str(m))
    out = OutputDir(tmp_path / "out")
    out.prepare({"format": "pt"}, fingerprints={"model": a})
    (tmp_path / "out" / "data_0.pt").write_bytes(b"x")  # (a sample written: a run to protect)
    (m / "model.safetensors").write_bytes(many_tensors({2: 3, 40: 5}))
    assert describe_model_change(a, fingerprint_checkpoint(str(m))) == [
        "weight file model.safetensors holds other values (same tensors and size, different contents)"
    ]
    with pytest.raises(OutputError, match=r"holds a different run .*model.safetensors holds other values"):
        run(m, jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out")


def test_a_weight_file_whose_time_changed_is_read_in_full(tmp_path, monkeypatch):
    """A byte between a tensor's samples changed, with the file's time: the whole-file CRC sees it.
    A copy (new time, same bytes) is the same model, and its new time is what the next resume
    compares; a file whose size and time are the recorded ones is not read in full again."""
    from speculators_compat import checkpoint

    monkeypatch.setenv("SPECULATORS_COMPAT_CACHE", str(tmp_path / "cache"))
    m = fake_model(tmp_path / "m", many_tensors())
    f = m / "model.safetensors"
    a = fingerprint_checkpoint(str(m))
    data = bytearray(f.read_bytes())
    data[len(data) - 64 * 1024 + 10_000] ^= 0xFF  # (the last tensor, 10,000 bytes in: no sample there)
    f.write_bytes(bytes(data))
    changed = fingerprint_checkpoint(str(m), known=a)
    assert (
        changed["weights"]["model.safetensors"]["tensors_sha256_sampled"]
        == (a["weights"]["model.safetensors"]["tensors_sha256_sampled"])
    )
    assert describe_model_change(a, changed) == [
        "weight file model.safetensors holds other values (same tensors and size, different contents)"
    ]
    data[len(data) - 64 * 1024 + 10_000] ^= 0xFF
    f.write_bytes(bytes(data))  # the original bytes again, at a new time (a copy)
    copy = fingerprint_checkpoint(str(m), known=a)
    assert describe_model_change(a, copy) == []
    read_in_full = []
    real = checkpoint.file_digest
    monkeypatch.setattr(checkpoint, "file_digest", lambda p, a: (a == "crc32" and read_in_full.append(p)) or real(p, a))
    assert describe_model_change(copy, fingerprint_checkpoint(str(m), known=copy)) == []
    assert read_in_full == []  # unchanged size and time: the recorded whole-file CRC stands
    checkpoint.crc_cache_file().unlink()
    fingerprint_checkpoint(str(m))
    assert read_in_full == [f]  # (a first run reads it, unless this user's cache knows it)


def test_a_new_output_over_the_same_model_takes_the_users_cached_crc(tmp_path, monkeypatch):
    """The whole-file CRC read by one run is kept in the user's cache and taken by the next run
    into another output while the file is untouched; a rewrite in place (a new time) or a
    replacement with the old time put back (a new inode) is read in full again and seen."""
    from speculators_compat import checkpoint

    monkeypatch.setenv("SPECULATORS_COMPAT_CACHE", str(tmp_path / "cache"))
    m = fake_model(tmp_path / "m", many_tensors())
    f = m / "model.safetensors"
    read_in_full = []
    real = checkpoint.file_digest
    monkeypatch.setattr(checkpoint, "file_digest", lambda p, a: (a == "crc32" and read_in_full.append(p)) or real(p, a))
    a = fingerprint_checkpoint(str(m))
    assert read_in_full == [f] and checkpoint.crc_cache_file().is_file()
    assert fingerprint_checkpoint(str(m)) == a and read_in_full == [f]  # taken from the cache
    data = bytearray(f.read_bytes())
    data[len(data) - 64 * 1024 + 10_000] ^= 0xFF  # (no sampled byte: only the whole-file CRC sees it)
    st = f.stat()
    replacement = m / "new.tmp"
    replacement.write_bytes(bytes(data))
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, f)  # same size and time, another inode
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    b = fingerprint_checkpoint(str(m))
    assert read_in_full == [f, f]
    assert describe_model_change(a, b) == [
        "weight file model.safetensors holds other values (same tensors and size, different contents)"
    ]
    checkpoint.crc_cache_file().write_text("{torn")  # a damaged cache is no error: the file is read
    assert fingerprint_checkpoint(str(m))["weights"] == b["weights"] and read_in_full == [f, f, f]


def test_input_fingerprint_covers_the_whole_file_and_names_the_change(tmp_path):
    f = jsonl(tmp_path / "in.jsonl", ROWS)
    full = scan_input(f)
    assert full.samples == 12 and full.fingerprint["bytes"] == f.stat().st_size
    part = scan_input(f, max_samples=5)
    assert part.samples == 5 and part.fingerprint == full.fingerprint  # --max-samples reads part, hashes all
    rows = [dict(r) for r in ROWS]
    rows[7]["input_ids"] = [9] + rows[7]["input_ids"][1:]  # same length, same size, one token differs
    jsonl(f, rows)
    changed = describe_input_change(full.fingerprint, scan_input(f).fingerprint)
    assert len(changed) == 1 and changed[0].startswith("the input's contents changed (same size, CRC-32")
    jsonl(f, ROWS[:11])
    assert describe_input_change(full.fingerprint, scan_input(f).fingerprint)[0].startswith("the input's size changed")


def test_overlength_samples_are_listed_by_the_scan(tmp_path):
    rows = ROWS + [{"input_ids": [5] * 600}, {"input_ids": [5] * 10}, {"input_ids": [5] * 2000}]
    s = scan_input(jsonl(tmp_path / "in.jsonl", rows), max_len=511)
    assert s.overlength == [(12, 600), (14, 2000)]


def test_the_scan_costs_one_read_of_the_input(tmp_path):
    """Prints the scan's rate on this machine (JSON parsing dominates; the CRC-32 alone is GB/s)."""
    f = jsonl(tmp_path / "in.jsonl", [{"input_ids": list(range(i % 97, i % 97 + 2000))} for i in range(500)])
    t = time.perf_counter()
    s = scan_input(f)
    dt = time.perf_counter() - t
    assert s.samples == 500
    print(f"scan_input: {f.stat().st_size / 2**20 / dt:.0f} MiB/s ({f.stat().st_size / 2**20:.1f} MiB in {dt:.2f} s)")


def test_a_resume_over_the_same_input_hashes_it_instead_of_parsing_it(tmp_path, monkeypatch):
    from speculators_compat.pipeline import dataset

    f = jsonl(tmp_path / "in.jsonl", ROWS + [{"input_ids": [5] * 700}])
    first = scan_input(f, max_len=511)
    monkeypatch.setattr(dataset, "iter_jsonl", lambda *a: (_ for _ in ()).throw(AssertionError("parsed again")))
    again = scan_input(f, max_len=511, known=first.record())
    assert again.recorded and (again.samples, again.overlength, again.fingerprint) == (
        13,
        [(12, 700)],
        first.fingerprint,
    )
    part = scan_input(f, max_samples=4, max_len=511, known=first.record())  # a part of what was read
    assert part.recorded and (part.samples, part.overlength) == (4, [])
    jsonl(f, ROWS[::-1] + [{"input_ids": [5] * 700}])  # other contents: parsed (here: the stand-in refuses)
    with pytest.raises(AssertionError, match="parsed again"):
        scan_input(f, max_len=511, known=first.record())
    with pytest.raises(AssertionError, match="parsed again"):  # another length limit: parsed
        scan_input(f, max_len=100, known=first.record())


def test_a_refused_run_leaves_nothing_in_a_directory_that_is_not_an_output(tmp_path, no_engine):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="holds no run.json"):
        run(fake_model(tmp_path / "m"), jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "notes")
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["notes.txt"]  # no .lock, no .run.lock
    bad = jsonl(tmp_path / "bad.jsonl", [{"input_ids": "x"}])
    with pytest.raises(DatasetError):
        run(fake_model(tmp_path / "m"), bad, tmp_path / "new")
    assert not (tmp_path / "new").exists()  # (made for the run, removed with its refusal)


def test_a_run_that_cannot_fit_its_disk_is_refused_before_the_engine(tmp_path, no_engine, monkeypatch):
    """What `plan` calls disk needed, against the output's free space. A full disk is a seam this
    machine cannot make on demand, so the free space is what shutil reports, patched."""
    import shutil

    m = fake_model(tmp_path / "m")
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps(dict(cfg, hidden_size=4096)))
    rows = [{"input_ids": [5] * 1000}] * 40  # 40,000 tokens x 3 layers x 4096 x 2 bytes: ~0.92 GiB
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=500 << 20))
    with pytest.raises(
        OutputError, match=r"the 40 samples left to compute need about 0.9 GiB in .*, which has 0.5 GiB free"
    ):
        run(m, jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", layer_ids=[1, 3, 5])
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=2 << 30))
    run_past_the_checks(m, jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", layer_ids=[1, 3, 5])

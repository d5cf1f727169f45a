"""Sharded safetensors output without an engine: the real ShardWriter and OutputDir on real files
(samples built here stand in for the engine's; tests/engine/test_pipeline.py runs the engine)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from speculators_compat.errors import OutputError
from speculators_compat.files.formats import done_from_shards, read_shard_range  # noqa: E402
from speculators_compat.pipeline.output.outdir import OutputDir  # noqa: E402
from speculators_compat.pipeline.output.verify import verify_output  # noqa: E402
from speculators_compat.pipeline.writers.shards import ShardWriter, check_shard_size, load_shard  # noqa: E402


def sample(i, n=None):
    n = n or 3 + i % 5
    g = torch.Generator().manual_seed(i)
    return {
        "input_ids": torch.arange(i, i + n),
        "loss_mask": torch.tensor([(i + j) % 2 for j in range(n)]),
        "hidden_states": [torch.randn(n, 8, generator=g).to(torch.bfloat16) for _ in range(3)],
    }


def write(root, indices, size, batch=4, n_seen=None, total=None, finish=True, threads=2):
    """Hand samples over as the pipeline does: fixed batches, ``upto`` after each."""
    out = OutputDir(root, "safetensors", shard_size=size)
    done = out.prepare({"m": 1, "shard_size": size}, total)
    w = ShardWriter(out, queue_size=2, threads=threads)
    todo = [i for i in indices if i not in done]
    end = n_seen if n_seen is not None else max(indices) + 1
    for b in range(0, end, batch):
        items = [(i, sample(i)) for i in todo if b <= i < b + batch]
        if items:
            w.put(items, upto=min(b + batch, end))
    if finish:
        w.finish(end)
    w.close()
    out.finalize(end, {"m": 1})
    return out, w, done


@pytest.mark.parametrize("threads", [1, 3])
def test_shards_hold_their_samples_by_index(tmp_path, threads):
    out, w, _ = write(tmp_path, list(range(11)), size=4, threads=threads)
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == [
        "shard_0.safetensors",
        "shard_1.safetensors",
        "shard_2.safetensors",
    ]
    assert w.written == 3
    assert read_shard_range(tmp_path / "shard_2.safetensors") == (8, 11, [8, 9, 10])
    for k in range(3):
        for got in load_shard(tmp_path / f"shard_{k}.safetensors"):
            want = sample(got["index"])
            assert got["index"] // 4 == k
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
            assert len(got["hidden_states"]) == 3
            assert all(torch.equal(a, b) for a, b in zip(got["hidden_states"], want["hidden_states"]))
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["shard_size"] == 4 and m["num_files"] == 3
    assert [f["samples"] for f in m["files"]] == [4, 4, 3]
    assert verify_output(tmp_path)["ok"]


def test_a_layer_listed_twice_goes_into_a_shard(tmp_path):
    """A repeated layer id gives one state twice (upstream's default ids on a 6-layer model);
    safetensors refuses tensors sharing memory, so the shard holds a copy."""
    from speculators_compat.pipeline.writers.shards import shard_bytes

    s = sample(0)
    s["hidden_states"] = [s["hidden_states"][0], s["hidden_states"][1], s["hidden_states"][1]]
    p = tmp_path / "shard_0.safetensors"
    p.write_bytes(shard_bytes([(0, s)], 0, 1))
    got = load_shard(p)[0]["hidden_states"]
    assert torch.equal(got[1], s["hidden_states"][1]) and torch.equal(got[2], s["hidden_states"][1])


def test_a_sample_left_out_leaves_a_gap_not_a_shift(tmp_path):
    write(tmp_path, [0, 1, 3, 4, 5], size=4, n_seen=6)  # sample 2 skipped (over-long, --on-overlength skip)
    assert read_shard_range(tmp_path / "shard_0.safetensors") == (0, 4, [0, 1, 3])
    assert [s["index"] for s in load_shard(tmp_path / "shard_0.safetensors")] == [0, 1, 3]


def test_resume_rewrites_a_short_last_shard_to_the_same_bytes(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    write(full, list(range(10)), size=4, threads=1)  # (threads: the bytes do not depend on them)
    write(part, list(range(6)), size=4)  # a --max-samples 6 run: shard 1 stops at 6
    assert read_shard_range(part / "shard_1.safetensors")[:2] == (4, 6)
    assert done_from_shards(part, 4, total=6) == set(range(6))  # the same run again: nothing to do
    assert done_from_shards(part, 4, total=10) == set(range(4))  # a longer one redoes shard 1
    assert done_from_shards(part, 4, total=None) == set(range(4))  # (length unknown: redone too)
    _, _, done = write(part, list(range(10)), size=4, total=10, threads=3)
    assert done == set(range(4))
    names = sorted(p.name for p in full.iterdir() if p.name.startswith("shard_") or p.name == "manifest.json")
    assert names == sorted(p.name for p in part.iterdir() if p.name.startswith("shard_") or p.name == "manifest.json")
    for n in names:
        assert (full / n).read_bytes() == (part / n).read_bytes(), n
    assert verify_output(part)["ok"]


def test_an_interrupted_run_writes_no_incomplete_shard(tmp_path):
    """No finish(): the run failed. Complete shards are on disk; the one being filled is not."""
    write(tmp_path, list(range(7)), size=4, n_seen=7, finish=False)
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == ["shard_0.safetensors"]
    (tmp_path / ".shard_1.safetensors.partial").write_bytes(b"torn")  # a crash mid-rename
    out = OutputDir(tmp_path, "safetensors", shard_size=4)
    assert out.prepare({"m": 1, "shard_size": 4}, 7) == set(range(4))
    assert not list(tmp_path.glob(".shard_*"))


def test_a_damaged_shard_is_computed_again_and_verify_names_it(tmp_path):
    write(tmp_path, list(range(8)), size=4)
    assert verify_output(tmp_path)["ok"]
    p = tmp_path / "shard_1.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the states: same size, checksum differs
    p.write_bytes(bytes(data))
    res = verify_output(tmp_path)
    assert not res["ok"] and any("shard_1.safetensors: crc32 differs" in x for x in res["problems"])
    p.write_bytes(b"not a safetensors file")
    assert done_from_shards(tmp_path, 4, 8) == set(range(4))


def test_a_shard_of_another_size_is_refused(tmp_path):
    write(tmp_path, list(range(8)), size=4)
    with pytest.raises(
        ValueError, match=r"shard_0.safetensors covers samples \[0, 4\), which is not shard 0 of size 2"
    ):
        done_from_shards(tmp_path, 2, 8)


def test_a_full_disk_is_an_error_at_the_next_put(small_disk):
    """A real 1 MiB tmpfs: the first shard (two samples of 800 KB) does not fit."""
    import time

    out = OutputDir(small_disk("1m"), "safetensors", shard_size=2)
    out.prepare({"m": 1})
    sw = ShardWriter(out, queue_size=1)
    big = [(i, {**sample(i, 50000), "hidden_states": [torch.zeros(50000, 8, dtype=torch.bfloat16)]}) for i in (0, 1)]
    sw.put(big, upto=2)
    deadline = time.time() + 10
    while sw.error is None and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(OutputError, match="No space left on device"):
        sw.put([(2, sample(2))], upto=3)
    with pytest.raises(OutputError):
        sw.close()
    assert not list(out.root.glob(".*.partial")) and not list(out.root.glob("shard_*"))


@pytest.mark.parametrize(
    "size,fmt,writer,msg",
    [
        (0, "safetensors", "auto", "--shard-size must be an integer >= 1"),
        (-3, "safetensors", "auto", "--shard-size must be an integer >= 1"),
        (2.5, "safetensors", "auto", "--shard-size must be an integer >= 1"),
        (True, "safetensors", "auto", "--shard-size must be an integer >= 1"),
        (4, "pt", "auto", "needs --format safetensors"),
        (4, "safetensors", "process", "--writer process is not supported"),
    ],
)
def test_bad_shard_options_are_named(size, fmt, writer, msg):
    with pytest.raises(ValueError, match=msg):
        check_shard_size(size, fmt, writer)


def test_run_extract_checks_the_shard_size_before_starting_an_engine(tmp_path):
    from speculators_compat.pipeline.extract import run_extract

    with pytest.raises(ValueError, match="needs --format safetensors"):
        run_extract(str(tmp_path / "no-model"), str(tmp_path / "no-input.jsonl"), str(tmp_path / "o"), shard_size=8)
    assert not (tmp_path / "o").exists()

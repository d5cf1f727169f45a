"""Ranks of a sharded run without an engine: which part a process computes (flags, torchrun,
Slurm), how samples are dealt, where engines go, and an output directory shared by ranks (locks,
run.json agreement, each rank's clean-up confined to its own files, the last rank's manifest,
verify over ranks). The engine side is tests/engine/test_scale_out.py."""

import json
import os

import pytest

from speculators_compat.errors import OutputError
from speculators_compat.pipeline import ranks
from speculators_compat.pipeline.output.outdir import OutputDir
from speculators_compat.pipeline.output.verify import finalize_output, verify_output
from speculators_compat.pipeline.ranks import Part, partition_unit, resolve_part


def test_flags_then_torchrun_then_slurm_then_the_whole_dataset():
    both = {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    p = resolve_part(1, 2, both)
    assert (p.rank, p.world_size, p.source) == (1, 2, "--rank/--world-size")
    p = resolve_part(environ=both)
    assert (p.rank, p.world_size) == (3, 4) and "torchrun" in p.source
    p = resolve_part(
        environ={"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x3)"}
    )
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (1, 2, 1, 2) and "Slurm" in p.source
    p = resolve_part(environ={})
    assert (p.rank, p.world_size, p.sharded) == (0, 1, False)


@pytest.mark.parametrize(
    "rank, world, env, named",
    [
        (2, 2, {}, "rank must be in [0, 2), not 2"),
        (None, 2, {}, "--rank and --world-size go together"),
        (None, None, {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        (None, None, {"SLURM_PROCID": "5", "SLURM_NTASKS": "4"}, "rank must be in [0, 4), not 5 (from SLURM_PROCID"),
    ],
)
def test_an_impossible_part_is_named(rank, world, env, named):
    with pytest.raises(ValueError) as e:
        resolve_part(rank, world, env)
    assert named in str(e.value)


def test_torchrun_variables_are_removed_before_the_engine_sees_them():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h"}
    assert ranks.forget_launcher_env(env) == ["RANK", "WORLD_SIZE", "LOCAL_RANK"]
    assert env == {"MASTER_ADDR": "h"}


def test_samples_are_dealt_by_whole_batches_round_robin():
    parts = [Part(r, 3) for r in range(3)]
    owners = [[p.rank for p in parts if p.owns(i, 4)] for i in range(40)]
    assert all(len(o) == 1 for o in owners)  # every sample exactly once
    assert [owners[i][0] for i in range(0, 40, 4)] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert all(owners[i] == owners[i - i % 4] for i in range(40))  # a batch never spans two ranks
    assert partition_unit(4, 1) == 4 and partition_unit(4, 12) == 12
    with pytest.raises(ValueError, match="multiple of --batch-size 4"):
        partition_unit(4, 10)
    assert Part(1, 2).sub(1, 4).rank == 5 and Part(1, 2).sub(1, 4).world_size == 8


def test_engines_get_disjoint_devices_and_cores():
    assert ranks.device_groups(["2", "3", "5", "7"], 2, 2) == [["2", "3"], ["5", "7"]]
    with pytest.raises(ValueError, match="need 6 GPUs; 4 are visible"):
        ranks.device_groups(["0", "1", "2", "3"], 3, 2)
    assert ranks.cpu_groups([0, 1], 2, 1) == ["0", "1"]
    assert ranks.cpu_groups(list(range(8)), 2, 2) == ["0,1|2,3", "4,5|6,7"]
    with pytest.raises(ValueError, match="need 4 CPUs; 2 are usable"):
        ranks.cpu_groups([0, 1], 2, 2)


def test_torchrun_shards_on_one_gpu_host_each_take_their_own_gpus(mocker, monkeypatch):
    """A GPU-only branch (no GPU here): device discovery is mocked; the pick itself is real."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mocker.patch("speculators_compat.host.cuda_device_count", return_value=8)
    part = Part(5, 8, "RANK/WORLD_SIZE (torchrun)", local_rank=1, local_size=4)
    assert ranks.pick_local_devices(part, 2) == "2,3" and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    # a launcher that already gave the shard exactly its GPUs: left alone
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    mocker.patch("speculators_compat.host.cuda_device_count", return_value=2)
    assert ranks.pick_local_devices(part, 2) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"


RUN = {"model": "/m", "input": "/in", "layer_ids": [1, 2], "format": "pt", "batch_size": 2, "world_size": 2}


def _rank(root, r, world=2, **run):
    out = OutputDir(root, part=Part(r, world), unit=2)
    out.lock()
    try:
        done = out.prepare(dict(RUN, world_size=world, **run), total=8, latest={"samples": 8})
    except BaseException:
        out.unlock()  # (as run_extract does)
        raise
    return out, done


def _write(out, i, data=b"x" * 10):
    from speculators_compat.pipeline.writers.threads import ChecksumLog

    (out.root / f"data_{i}.pt").write_bytes(data)
    log = ChecksumLog(out)
    import zlib

    log.add(i, f"{zlib.crc32(data):08x}", len(data), 5)
    log.close()


def test_ranks_share_a_directory_and_judge_only_their_own_files(tmp_path):
    r0, _ = _rank(tmp_path, 0)
    r1, _ = _rank(tmp_path, 1)  # (both hold the directory at once)
    for i in (0, 1, 4, 5):
        _write(r0, i)
    _write(r1, 2)
    # rank 1's file in flight and one of its files without a record (as if it had crashed)
    (tmp_path / ".data_3.pt.partial").write_bytes(b"torn")
    (tmp_path / "data_7.pt").write_bytes(b"unrecorded")
    r0.unlock()
    r0, done0 = _rank(tmp_path, 0)  # rank 0 resumes: rank 1's files are not its business
    assert done0 == {0, 1, 4, 5}
    assert (tmp_path / ".data_3.pt.partial").exists() and (tmp_path / "data_7.pt").exists()
    assert (tmp_path / "rank_0" / "checksums.jsonl").exists() and not (tmp_path / "checksums.jsonl").exists()
    r1.unlock()
    r1, done1 = _rank(tmp_path, 1)  # rank 1 resumes: its partial and its unrecorded file go
    assert done1 == {2} and not (tmp_path / ".data_3.pt.partial").exists() and not (tmp_path / "data_7.pt").exists()
    with pytest.raises(OutputError, match="rank 1 of 2 of .* is being written by another extract .pid"):
        OutputDir(tmp_path, part=Part(1, 2), unit=2).lock()
    with pytest.raises(OutputError, match="the ranks of a sharded extract .rank_0, rank_1."):
        OutputDir(tmp_path).lock()  # a one-engine run cannot join them


def test_ranks_must_agree_on_the_run(tmp_path):
    r0, _ = _rank(tmp_path, 0)
    with pytest.raises(OutputError, match=r"rank 1 of 2: .* \(layer_ids: \[1, 2\] -> \[1, 3\]\)"):
        _rank(tmp_path, 1, layer_ids=[1, 3])
    with pytest.raises(OutputError, match="batch_size: 2 -> 4"):  # (a one-engine resume may change it)
        _rank(tmp_path, 1, batch_size=4)
    with pytest.raises(OutputError, match="world_size: 2 -> 3"):
        OutputDir(tmp_path, part=Part(1, 3), unit=2).prepare(dict(RUN, world_size=3), total=8)


def test_the_last_rank_to_finish_writes_the_manifest_and_verify_names_the_rest(tmp_path):
    r0, _ = _rank(tmp_path, 0)
    r1, _ = _rank(tmp_path, 1)
    for i in (0, 1, 4, 5):
        _write(r0, i)
    for i in (2, 3, 6):
        _write(r1, i)
    extra = {"model": "/m", "layer_ids": [1, 2], "num_samples": 8, "versions": {"vllm": "1"}, "hidden_size": 4}
    r0.mark_done(8, extra, {})
    assert r0.finalize_if_complete() is None and not (tmp_path / "manifest.json").exists()
    res = verify_output(tmp_path)
    assert res["ok"] and not res["complete"] and res["missing"] == [7]
    assert [(r["rank"], r["missing"], r["done"]) for r in res["ranks"]] == [(0, [], True), (1, [7], False)]
    assert not finalize_output(tmp_path)["complete"]  # (a sample is missing: no manifest)
    _write(r1, 7)
    r1.mark_done(8, dict(extra, hidden_size=None), {})
    m = r1.finalize_if_complete()
    assert m["num_files"] == 8 and m["hidden_size"] == 4 and [f["index"] for f in m["files"]] == list(range(8))
    assert verify_output(tmp_path)["complete"]


def test_verify_finalize_seals_a_dataset_whose_last_rank_stopped_before_its_manifest(tmp_path, capsys):
    from speculators_compat.cli import main

    r0, _ = _rank(tmp_path, 0)
    r1, _ = _rank(tmp_path, 1)
    for i in range(8):
        _write(r0 if (i // 2) % 2 == 0 else r1, i)
    extra = {"model": "/m", "layer_ids": [1, 2], "num_samples": 8, "versions": {}, "hidden_size": 4}
    r0.mark_done(8, extra, {})  # rank 1 wrote every file, then died before its done.json
    assert main(["verify", str(tmp_path)]) == 3
    said = capsys.readouterr().out
    assert "rank 1 of 2 has every file but did not finish" in said and "verify --finalize" in said
    assert main(["verify", str(tmp_path), "--finalize"]) == 0
    assert json.loads((tmp_path / "manifest.json").read_text())["num_files"] == 8


def test_data_parallel_engines_split_the_host(mocker, monkeypatch):
    """Where each of D engines goes: its CPUs always, its GPUs on a GPU host (a GPU-only branch:
    device discovery is mocked there; the split is real)."""
    from speculators_compat.pipeline.scale.parallel import placements

    mocker.patch("os.sched_getaffinity", return_value=set(range(8)))
    mocker.patch("speculators_compat.host.cuda_device_count", return_value=0)
    assert placements(2, 1) == [
        ({"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3"}, [0, 1, 2, 3]),
        ({"VLLM_CPU_OMP_THREADS_BIND": "4,5,6,7"}, [4, 5, 6, 7]),
    ]
    assert placements(2, 2)[1][0] == {"VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    mocker.patch("speculators_compat.host.cuda_device_count", return_value=8)
    got = placements(4, 2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e, _ in got] == ["0,1", "2,3", "4,5", "6,7"]
    assert [c for _, c in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [e for e, _ in placements(2, 1, devices=[["0"], ["0"]])] == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2
    with pytest.raises(ValueError, match="need 10 GPUs; 8 are visible"):
        placements(5, 2)


def test_a_ray_cluster_failure_is_a_shard_failure_not_a_raw_error(monkeypatch):
    """A lost node takes the actors on it (the progress actor too) and Ray raises ActorDiedError
    outside any shard's result. A node crash is a seam one machine cannot make, so the run's loop
    is replaced by one raising Ray's own error; the command must say ShardFailedError and how to
    resume."""
    ray = pytest.importorskip("ray")
    from speculators_compat.errors import ShardFailedError
    from speculators_compat.pipeline.scale import ray_shards

    def lost(*a, **k):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # (no local instance started)
    monkeypatch.setattr(ray_shards, "_run", lost)
    with pytest.raises(
        ShardFailedError, match=r"the Ray cluster failed under the run \(ActorDiedError.*run the same command again"
    ):
        ray_shards.run_on_ray("m", "in.jsonl", "out", shards=2)


def test_the_merged_summary_finds_the_manifest_where_the_format_keeps_it(tmp_path):
    """--format speculators-hs keeps its manifest in hidden_states/ (output/layout.py): the merged
    summary of a data-parallel or Ray run said dataset_complete False though it was there."""
    from speculators_compat.pipeline.output.layout import Layout
    from speculators_compat.pipeline.scale.parallel import merge_summaries

    one = {"samples": 4, "seconds": 2.0, "engine_start_s": 1.0, "truncated": 0, "skipped_overlength": 0}
    assert merge_summaries([one, one], str(tmp_path), 1.0, "speculators-hs")["dataset_complete"] is False
    (tmp_path / "hidden_states").mkdir()
    (tmp_path / "hidden_states" / "manifest.json").write_text("{}")
    assert merge_summaries([one, one], str(tmp_path), 1.0, "speculators-hs")["dataset_complete"] is True
    assert merge_summaries([one, one], str(tmp_path), 1.0, "pt")["dataset_complete"] is False
    hs = Layout.of(tmp_path, "speculators-hs")
    assert (hs.states, hs.manifest, hs.trainer_dataset) == (
        tmp_path / "hidden_states",
        tmp_path / "hidden_states" / "manifest.json",
        tmp_path,
    )
    (tmp_path / "hidden_states" / "run.json").write_text('{"format": "speculators-hs"}')
    assert Layout.find(tmp_path) == hs == Layout.find(tmp_path / "hidden_states")
    assert Layout.of(tmp_path, "pt").states == tmp_path and Layout.of(tmp_path, "pt").trainer_dataset is None

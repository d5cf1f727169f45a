"""The crash guarantee of every writer: a file is recorded in checksums.jsonl only once it is
durable (fdatasync'd under its temporary name, then renamed), and a run killed with SIGKILL in the
middle of writing leaves only whole, recorded files that the rerun keeps (and nothing it trusts
that was not synced). The writer runs in a child process (tests/pipeline/writers/kill_target.py) that
logs, in every process of it, each fdatasync and rename in the order they happen."""

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from speculators_compat.pipeline.output.outdir import OutputDir

ROOT = Path(__file__).resolve().parents[3]


def _run_and_kill(out: Path, kind: str, log: Path, records: int) -> None:
    env = dict(os.environ, SC_KILL_TARGET_LOG=str(log), PYTHONPATH=str(ROOT))
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.pipeline.writers.kill_target", str(out), kind],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # (the writer processes are killed with it)
    )
    sums = out / "checksums.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (sums.exists() and sums.read_text().count("\n") >= records):
            if p.poll() is not None:
                pytest.fail(f"the writer run ended by itself (rc {p.returncode}): {p.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, "no files recorded within 120 s"
            time.sleep(0.01)
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # mid-write: more files are in flight
        p.wait(timeout=30)


@pytest.mark.parametrize("kind", ["thread", "process", "shards"])
def test_sigkill_mid_write_leaves_only_durable_recorded_files_and_the_rerun_keeps_them(tmp_path, kind):
    pytest.importorskip("torch")
    out, log = tmp_path / "out", tmp_path / "sync.log"
    _run_and_kill(out, kind, log, records=6)
    events = log.read_text().splitlines()
    recorded = []
    for line in (out / "checksums.jsonl").read_text().splitlines():
        try:
            recorded.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line: the kill hit the record's write
            continue
    assert len(recorded) >= 6
    for rec in recorded:
        name = rec["file"]
        assert rec["durable"] is True
        temp = f".{name}.partial"
        rename = events.index(f"rename {temp} {name}")  # (ValueError: never renamed into place)
        assert f"sync {temp}" in events[:rename], f"{name} was renamed before its data was synced"
        data = (out / name).read_bytes()
        assert len(data) == rec["bytes"] and f"{zlib.crc32(data):08x}" == rec["crc32"], name
    # the rerun: every recorded file kept (none computed again), leftovers of the kill swept
    fmt, shard = ("safetensors", 4) if kind == "shards" else ("pt", 1)
    od = OutputDir(out, fmt, shard_size=shard)
    left = len(list(out.glob(".*.partial")))
    kept = od.prepare({"kill-target": True}, total=10**6)
    assert od.swept == left  # (the rerun says how many temporaries it removed)
    first = {r["index"] for r in recorded}
    if shard > 1:
        first = {i + k for i in first for k in range(shard)}
    assert first <= kept
    assert not list(out.glob(".*.partial"))
    on_disk = {p.name for p in out.iterdir() if p.name.startswith(("data_", "shard_"))}
    assert on_disk == {r["file"] for r in recorded}, "a file on disk the records do not hold survived"

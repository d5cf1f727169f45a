"""``speculators-compat extract`` as a command, each case in processes of its own: a killed worker,
the Kimi-K2.5 recipe on the tiny model, host memory as the dataset grows.

Kept apart from test_pipeline.py so that its module-wide engine is closed before these start
(an idle vLLM worker polls its queue and takes most of a core: one engine at a time).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import make_jsonl, read_dir


def _worker_pids(pid: int) -> list[int]:
    import psutil

    out = []
    for c in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
        except psutil.Error:
            continue
        if "VLLM::Worker" in cmd or "VllmWorker" in c.name():  # vLLM retitles its worker processes
            out.append(c.pid)
    return out


CLI = [
    sys.executable,
    "-m",
    "speculators_compat.cli",
    "extract",
    "--layer-ids",
    "1,3,5",
    "--dtype",
    "float32",
    "--batch-size",
    "2",
    "--max-model-len",
    "2048",
    "--max-num-batched-tokens",
    "256",
    "--no-progress",
]


ENV = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")


@pytest.fixture(scope="module")
def uninterrupted(llama_path, tmp_path_factory):
    """The input of the interruption tests and the dataset an uninterrupted run makes of it:
    enough work that an interruption lands mid-run even on a fast machine (90 samples, of which the
    4th was written 23 s into a 36 s run on the 2-core CPU, vLLM 0.12; the tests say if not)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    make_jsonl(d / "in.jsonl", lengths=[700, 650, 800, 900, 600, 750] * 15, seed=3)
    args = CLI + ["--model", llama_path, "--input", str(d / "in.jsonl")]
    ref = subprocess.run(args + ["--output", str(d / "ref")], capture_output=True, text=True, env=ENV)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return args, d / "ref"


def _start_and_wait_for_files(args, out, n=4, new_session=False):
    p = subprocess.Popen(
        args + ["--output", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        start_new_session=new_session,
    )
    deadline = time.time() + 300
    while time.time() < deadline and len(list(out.glob("data_*.pt"))) < n and p.poll() is None:
        time.sleep(0.2)
    assert p.poll() is None, f"pipeline ended before the interruption (rc {p.returncode}): {p.stdout.read()[-3000:]}"
    return p


def _wait_for_exit(p, after: str):
    """(output, seconds) of the pipeline's exit, timed from now; a failure if it takes 120 s."""
    t = time.time()
    try:
        log, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"pipeline did not stop within 120 s after {after}")
    took = time.time() - t
    print(f"pipeline stopped {took:.1f}s after {after} (rc {p.returncode})")
    return log, took


def _files_intact_and_resume_identical(args, out, ref):
    import torch

    done = sorted(out.glob("data_*.pt"))
    assert done and not list(out.glob(".data_*.partial"))
    for f in done:  # every completed file is intact
        torch.load(f, weights_only=True)
    again = subprocess.run(args + ["--output", str(out)], capture_output=True, text=True, env=ENV)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert read_dir(out) == read_dir(ref)


def test_killed_worker_errors_fast_and_resume_is_identical(uninterrupted, tmp_path):
    pytest.importorskip("psutil")
    args, ref = uninterrupted
    out = tmp_path / "run"
    import glob

    before = set(glob.glob("/dev/shm/*"))
    p = _start_and_wait_for_files(args, out)
    victims = _worker_pids(p.pid)
    assert victims, "no vLLM worker process found among the pipeline's children"
    os.kill(victims[-1], signal.SIGKILL)
    log, took = _wait_for_exit(p, "the worker was killed")
    assert p.returncode == 2, log[-3000:]  # the documented error, every time, not vLLM's raw one
    assert "speculators-compat: error: a vLLM worker process died during extraction" in log, log[-3000:]
    assert "rerun to resume" in log and "Traceback" not in log, log[-3000:]
    assert took < 60, f"took {took:.1f}s to notice the dead worker"
    # its last words: the message is the last line (no third-party teardown noise after it), and
    # none of its shared memory is left behind
    assert log.rstrip().splitlines()[-1].startswith("speculators-compat: error: a vLLM worker process died"), log[
        -3000:
    ]
    time.sleep(3)  # (the dead engine's other worker processes end on their own)
    assert not set(glob.glob("/dev/shm/*")) - before - set(glob.glob("/dev/shm/__KMP_REGISTERED_LIB_*"))
    _files_intact_and_resume_identical(args, out, ref)


@pytest.mark.parametrize(
    "to", [pytest.param("driver", marks=pytest.mark.ends), pytest.param("group", marks=pytest.mark.slow)]
)
def test_sigterm_shuts_down_cleanly_and_resume_is_identical(uninterrupted, tmp_path, to):
    """SIGTERM (what a batch scheduler sends a job it preempts, and ``kill``'s default) mid-run, to
    the driver or to its whole process group (as scancel does: the workers get it too). Python's
    default ended the driver on the spot (measured on 0.32: exit -15, and its arena files stayed
    in /dev/shm until the next engine started on that host). Now it is handled like Ctrl-C: the
    workers are shut down, the arena is removed, the exit code is 143 and the message says how to
    resume (not that a worker died); the rerun completes the byte-identical dataset."""
    import glob

    psutil = pytest.importorskip("psutil")
    args, ref = uninterrupted
    out = tmp_path / "run"
    p = _start_and_wait_for_files(args, out, new_session=to == "group")
    arenas = set(glob.glob("/dev/shm/speculators-compat-*"))
    children = psutil.Process(p.pid).children(recursive=True)
    assert _worker_pids(p.pid)
    if to == "group":
        os.killpg(p.pid, signal.SIGTERM)
    else:
        p.send_signal(signal.SIGTERM)
    log, took = _wait_for_exit(p, "SIGTERM")
    assert p.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "interrupted by SIGTERM" in log and "run the same command again to resume" in log, log[-3000:]
    assert "worker process died" not in log, log[-3000:]
    assert took < 60
    gone_by = time.time() + 10
    while time.time() < gone_by and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        time.sleep(0.2)
    assert not [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    if os.environ.get("SPECULATORS_COMPAT_HANDOFF", "shm") == "shm":
        assert arenas, "no arena file seen in /dev/shm while the pipeline ran"
    assert not arenas & set(glob.glob("/dev/shm/speculators-compat-*")), "the run's arena files were left in /dev/shm"
    _files_intact_and_resume_identical(args, out, ref)


@pytest.mark.ends
def test_kimi_recipe_runs_on_the_tiny_model(llama_path, tmp_path):
    """examples/kimi_k25_int4_8gpu.py with the tiny model in place of Kimi (TP=1, CPU): every setting
    of the recipe except the model and the parallelism is the real one."""
    import glob

    root = Path(__file__).resolve().parents[2]
    make_jsonl(tmp_path / "in.jsonl", lengths=[30, 200, 7, 90], seed=4)
    before = set(glob.glob("/dev/shm/speculators-compat-*"))
    r = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "kimi_k25_int4_8gpu.py"),
            "--model",
            llama_path,
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out"),
            "--tensor-parallel-size",
            "1",
            "--layer-ids",
            "1,3,5",
            "--max-model-len",
            "2048",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["num_files"] == 4
    # the pipeline closes the engine it started: no arena file of it is left in /dev/shm
    assert set(glob.glob("/dev/shm/speculators-compat-*")) <= before


@pytest.mark.slow
def test_host_memory_stays_flat_as_the_dataset_grows(llama_path, tmp_path):
    """Peak RSS of the pipeline's driver process for 40 and for 160 samples (same batches): the
    bounded write queue must keep it flat, not proportional to the dataset."""
    psutil = pytest.importorskip("psutil")
    make_jsonl(tmp_path / "in.jsonl", lengths=[700, 650, 800, 900, 600, 750] * 30, seed=6)
    peaks = {}
    for n in (40, 160):
        p = subprocess.Popen(
            CLI
            + [
                "--model",
                llama_path,
                "--input",
                str(tmp_path / "in.jsonl"),
                "--output",
                str(tmp_path / f"o{n}"),
                "--max-samples",
                str(n),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"),
        )
        proc, peak = psutil.Process(p.pid), 0
        while p.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.Error:
                break
            time.sleep(0.05)
        assert p.returncode == 0
        peaks[n] = peak
    print(f"driver peak RSS: 40 samples {peaks[40] / 2**20:.0f} MiB, 160 samples {peaks[160] / 2**20:.0f} MiB")
    assert peaks[160] < peaks[40] * 1.25 + 64 * 2**20

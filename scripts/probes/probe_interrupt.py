"""Interrupt ``speculators-compat extract`` mid-run with a signal, and record what is left behind.

    python scripts/probes/probe_interrupt.py OUTDIR [--signal TERM|INT|HUP|KILL] [--group] [--after N]
                                     [--samples N] [--tokens N] [-- EXTRA EXTRACT ARGS]

On the built-in tiny Llama: one uninterrupted run (the reference), then a run that gets the
signal once N files are written (to the driver alone, or with --group to its whole process
group, as a terminal's Ctrl-C or a scheduler's scancel does), then the same command again.
Prints and writes ``OUTDIR/interrupt.json``: the exit status and how long the driver took to
exit, the child processes still alive 10 s later, the /dev/shm files of ours left, partial
files, and whether the resumed dataset is byte-identical to the reference. Used on the CPU
machine and on the H200 (docs/results/*sig*.json).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from speculators_compat.testing import models


def _dataset(path: Path, n: int, tokens: int) -> None:
    prompts = models.random_prompts([tokens - (i % 7) * 13 for i in range(n)], seed=11)
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("data_*"))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--signal", default="TERM", choices=("TERM", "INT", "HUP", "KILL"))
    ap.add_argument("--group", action="store_true", help="signal the whole process group")
    ap.add_argument("--after", type=int, default=4, help="files written before the signal")
    ap.add_argument("--samples", type=int, default=90)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("extra", nargs="*", help="more extract arguments (after --)")
    a = ap.parse_args()
    root = Path(a.outdir)
    root.mkdir(parents=True, exist_ok=True)
    _dataset(root / "in.jsonl", a.samples, a.tokens)
    cli = [
        sys.executable,
        "-m",
        "speculators_compat.cli",
        "extract",
        "--model",
        str(models.build("llama")),
        "--input",
        str(root / "in.jsonl"),
        "--layer-ids",
        "1,3,5",
        "--batch-size",
        "2",
        "--max-model-len",
        "2048",
        "--no-progress",
        *a.extra,
    ]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    rec: dict = {
        "signal": f"SIG{a.signal}",
        "group": a.group,
        "after_files": a.after,
        "samples": a.samples,
        "extra": a.extra,
    }
    t = time.time()
    ref = subprocess.run(cli + ["--output", str(root / "ref")], capture_output=True, text=True, env=env)
    rec["reference_rc"], rec["reference_s"] = ref.returncode, round(time.time() - t, 1)
    if ref.returncode != 0:
        print(ref.stderr[-3000:])
        return 1
    ours_before = set(glob.glob("/dev/shm/speculators-compat-*"))
    out = root / "run"
    p = subprocess.Popen(
        cli + ["--output", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=a.group,
    )
    while len(list(out.glob("data_*"))) < a.after and p.poll() is None:
        time.sleep(0.05)
    if p.poll() is not None:
        print(f"the run ended before {a.after} files (rc {p.returncode}); use more --samples")
        return 1
    children = psutil.Process(p.pid).children(recursive=True)
    ours_running = set(glob.glob("/dev/shm/speculators-compat-*")) - ours_before
    rec["shm_bytes_during_run"] = sum(os.path.getsize(f) for f in ours_running if os.path.exists(f))
    sig = getattr(signal, f"SIG{a.signal}")
    rec["files_at_signal"] = len(list(out.glob("data_*")))
    t = time.time()
    os.killpg(p.pid, sig) if a.group else p.send_signal(sig)
    try:
        log, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        rec["hang"] = True
        p.kill()
        log, _ = p.communicate()
    rec["rc"], rec["exit_s"] = p.returncode, round(time.time() - t, 2)
    deadline = time.time() + 10
    while time.time() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        time.sleep(0.2)
    rec["children"] = len(children)
    rec["children_alive_after_10s"] = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    rec["shm_files_during_run"] = len(ours_running)
    left = ours_running & set(glob.glob("/dev/shm/*"))
    rec["shm_files_left"] = sorted(os.path.basename(f) for f in left)
    rec["shm_bytes_left"] = sum(os.path.getsize(f) for f in left)
    rec["partial_files_left"] = sorted(f.name for f in out.glob(".*partial"))
    rec["files_after_exit"] = len(list(out.glob("data_*")))
    rec["message"] = next(
        (ln for ln in log.splitlines() if "interrupted by" in ln), (log.strip().splitlines() or [""])[-1]
    ).replace(str(out), "OUTPUT")
    t = time.time()
    again = subprocess.run(cli + ["--output", str(out)], capture_output=True, text=True, env=env)
    rec["resume_rc"], rec["resume_s"] = again.returncode, round(time.time() - t, 1)
    rec["resume_identical"] = again.returncode == 0 and _files(out) == _files(root / "ref")
    print(json.dumps(rec, indent=1))
    (root / "interrupt.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

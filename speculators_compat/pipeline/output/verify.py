"""``speculators-compat verify OUTPUT``: check an extraction's files against its manifest.

Reads ``manifest.json`` (or, for a run that has not finished, ``checksums.jsonl``) and checks that
every listed file exists with the listed size and checksum (whichever algorithm the record names:
crc32 or sha256; a record without one is checked for size only). Data files on disk that the
list lacks are reported too. Reads each file once, in 8 MiB pieces; no torch needed.

Then whether the dataset is complete: run.json records how many samples the run reads, so an
output whose run has not finished (no manifest.json), or that lacks some samples' files, is
reported INCOMPLETE with the missing indices. Exit status: 0 complete and intact, 1 a damaged or
missing file, 3 intact but incomplete.

A sharded run (``--world-size N``) is checked as one dataset: every rank's records together, every
index present once, and for each incomplete rank which samples it still owes (and the command
that completes it). ``--finalize`` writes the whole dataset's manifest when every sample's file
is there and intact: for a dataset whose last rank did not get to write it (it is also the way to
seal a one-engine output whose run stopped after its last file).
"""

from __future__ import annotations

import json
from pathlib import Path

from ...files.checksums import CHECKSUMS, file_digest
from ...files.formats import SHARD_FILE_RE
from ...files.registry import data_file_index, get_format
from .layout import Layout
from .outdir import OutputDir


def records_root(root: str | Path) -> Path:
    """Where the run's records are, for the folder the user named (layout.py)."""
    return Layout.find(root).states


def verify_output(root: str | Path) -> dict:
    """{"source", "checked", "problems": [str], "ok"} for the output directory ``root``."""
    root = records_root(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no output directory at {root}")
    manifest = root / "manifest.json"
    if manifest.exists():
        source, records = "manifest.json", json.loads(manifest.read_text())["files"]
    elif (root / "checksums.jsonl").exists() or any(root.glob("rank_*/checksums.jsonl")):
        # (a torn last line: that file shows up as unlisted)
        by_index = OutputDir(root).checksum_records(all_ranks=True)
        source, records = "checksums.jsonl", [by_index[i] for i in sorted(by_index)]
    elif (root / "run.json").exists():  # (a run that stopped before its first file)
        source, records = "run.json", []
    else:
        raise FileNotFoundError(f"{root} has neither manifest.json nor checksums.jsonl: not an extract output")
    problems = [p for rec in records if (p := _check_file(root, rec))]
    run = _run_record(root)
    if run.get("states_dtype") == "fp8":
        problems += [p for rec in records if (p := check_fp8_file(root / rec["file"], run))]
    listed = {rec["file"] for rec in records}
    dataset = json.loads(manifest.read_text()).get("dataset") if manifest.exists() else None
    for rec in (dataset or {}).get("files", []):  # (speculators-hs: its input_ids/loss_mask dataset)
        if problem := _check_file(root / dataset["path"], rec):
            problems.append(f"dataset file {problem}")
    unrecorded = []  # (a run still writing, or stopped: a file renamed in just before its record)
    for p in sorted(root.iterdir()):
        if (data_file_index(p.name) is not None or SHARD_FILE_RE.match(p.name)) and p.name not in listed:
            if source == "manifest.json":
                problems.append(f"{p.name}: on disk but not listed in {source}")
            else:
                unrecorded.append(p.name)
    res = {"source": source, "checked": len(records), "problems": problems, "ok": not problems}
    if unrecorded:
        res["unrecorded"] = unrecorded
    res.update(_completeness(root, records, finished=source == "manifest.json"))
    return res


def _check_file(folder: Path, rec: dict) -> str | None:
    """What is wrong with the file ``rec`` lists in ``folder`` (missing, size, checksum), or None."""
    name = rec["file"]
    p = folder / name
    if not p.exists():
        return f"{name}: missing"
    size = p.stat().st_size
    if size != rec["bytes"]:
        return f"{name}: {size} bytes, listed as {rec['bytes']}"
    algo = next((k for k in CHECKSUMS if k in rec), None)
    if algo is not None and file_digest(p, algo) != rec[algo]:
        return f"{name}: {algo} differs from the listed {rec[algo]} (the file changed or is corrupt)"
    return None


def _run_record(root: Path) -> dict:
    try:
        return json.loads((root / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def check_fp8_file(path: Path, run: dict) -> str | None:
    """What is wrong with the FP8 states in data file ``path`` (their dtype, shapes against its
    tokens and the run's layers and hidden size, scales finite and > 0), or None. A missing file
    is the checksum check's to report."""
    if not path.exists():
        return None
    try:
        states, scales, tokens = _fp8_contents(path, run.get("format", "pt"))
    except Exception as e:  # an unreadable file is a problem to list, not to stop verify on
        return f"{path.name}: cannot read its FP8 states ({type(e).__name__}: {e})"
    import torch

    from ...engine.fp8 import fp8_dtype

    layers, hidden = len(run.get("layer_ids") or []), run.get("hidden_size")
    bad = [f"{tuple(h.shape)} {h.dtype}" for h in states if h.dtype != fp8_dtype() or h.shape[0] != tokens]
    bad += [f"hidden size {h.shape[-1]}, not {hidden}" for h in states if hidden and h.shape[-1] != hidden][:1]
    if layers and len(states) != layers:
        bad.append(f"{len(states)} layers, not {layers}")
    if scales.dtype != torch.float32 or scales.numel() != tokens:
        bad.append(f"scales {tuple(scales.shape)} {scales.dtype} for {tokens} tokens")
    elif not bool((torch.isfinite(scales) & (scales > 0)).all()):
        bad.append("a scale that is not finite and > 0")
    return f"{path.name}: FP8 states: {'; '.join(bad)}" if bad else None


def _fp8_contents(path: Path, fmt: str) -> tuple[list, object, int]:
    """(e4m3 states per layer, scales, tokens) of an FP8 data file of format ``fmt`` (its reader)."""
    from ...engine.fp8 import SCALES_KEY

    d = get_format(fmt).read(path)
    if SCALES_KEY not in d:
        raise ValueError("its hidden_states are not FP8 states (no scales)")
    return list(d["hidden_states"]), d[SCALES_KEY], int(d["input_ids"].numel())


def _completeness(root: Path, records: list[dict], finished: bool) -> dict:
    """Whether every sample of the run is on disk: ``complete``, ``expected`` (from run.json) and
    ``missing`` (indices with no file that the run did not skip as over-long)."""
    run = _run_record(root)
    expected = run.get("samples")
    if expected is None:  # (an output written before run.json recorded its size)
        return {"complete": finished, "expected": None, "missing": None}
    have = set()
    for rec in records:
        first = int(rec["index"])
        have.update(range(first, first + int(rec.get("samples") or 1)))
    skipped = set(run.get("skipped_overlength") or [])
    if (root / "manifest.json").exists():  # the run's own account of what it skipped
        skipped |= set(json.loads((root / "manifest.json").read_text()).get("skipped_overlength") or [])
    if run.get("shard_size", 1) > 1:  # a shard lists what it holds; records count the whole range
        have = _shard_indices(root, records)
    missing = [i for i in range(expected) if i not in have and i not in skipped]
    res = {"complete": finished and not missing, "expected": expected, "missing": missing}
    world = int(run.get("world_size", 1))
    if world > 1:
        from ..ranks import partition_unit

        unit = partition_unit(int(run.get("batch_size", 1)), int(run.get("shard_size", 1)))
        res["world_size"] = world
        res["ranks"] = [
            {
                "rank": r,
                "missing": [i for i in missing if (i // unit) % world == r],
                "done": (root / f"rank_{r}" / "done.json").exists(),
            }
            for r in range(world)
        ]
    return res


def _shard_indices(root: Path, records: list[dict]) -> set[int]:
    """The sample indices the shards hold, from their safetensors metadata (read without torch)."""
    from ...checkpoint import CheckpointError, read_safetensors_header

    have = set()
    for rec in records:
        try:
            raw, _ = read_safetensors_header(root / rec["file"])
            meta = json.loads(json.loads(raw).get("__metadata__", {}).get("speculators_compat", "{}"))
            have.update(int(i) for i in meta.get("indices", []))
        except (OSError, ValueError, CheckpointError, AttributeError):
            continue  # (reported above as missing or damaged)
    return have


def _ranges(ix: list[int]) -> str:
    out, start = [], None
    for a, b in zip([None] + ix, ix + [None]):
        if start is None:
            start = b
        elif b is None or b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out[:8]) + (" ..." if len(out) > 8 else "")


def finalize_output(root: str | Path) -> dict:
    """Write manifest.json for the output at ``root`` if every sample's file is there and intact
    (``verify --finalize``); returns verify_output's result after it."""
    from ... import versions
    from ..ranks import Part, merged_extra

    root = records_root(root)
    res = verify_output(root)
    if not res["ok"] or res["missing"] or res["expected"] is None or (root / "manifest.json").exists():
        return res
    run = json.loads((root / "run.json").read_text())
    world = int(run.get("world_size", 1))
    first = next(iter(OutputDir(root).checksum_records(all_ranks=True).values()), {})
    out = OutputDir(
        root,
        run.get("format", "pt"),
        next((k for k in CHECKSUMS if k in first), "none") if first else None,
        int(run.get("shard_size", 1)),
        Part(0, world),
    )
    done = out.ranks_done() if world > 1 else {}
    if done:
        extra = merged_extra(done)
    else:  # (no rank finished: the run's own record says what it read)
        overlength = [i for i, _ in (run.get("input_scan") or {}).get("overlength", [])]
        extra = {
            "model": run.get("model"),
            "layer_ids": run.get("layer_ids"),
            "num_samples": run["samples"],
            "truncated": overlength if run.get("on_overlength") == "truncate" else [],
            "skipped_overlength": run.get("skipped_overlength") or [],
            "versions": versions.report(),
            "hidden_size": run.get("hidden_size"),
        }
    out.finalize(run["samples"], extra)
    return verify_output(root)


def model_problems(root: str | Path, model: str) -> list[str]:
    """Why the states under ``root`` were not made by ``model``'s files (run.json's fingerprint of
    the model that made them against ``model``'s), or nothing when they were."""
    from ...checkpoint import describe_model_change, fingerprint_checkpoint

    run = _run_record(records_root(root))
    recorded = (run.get("fingerprints") or {}).get("model")
    if recorded is None:
        return [f"{records_root(root)}/run.json records no fingerprint of the model that made it: cannot tell"]
    changes = describe_model_change(recorded, fingerprint_checkpoint(model, known=recorded))
    if not changes:
        return []
    return [f"these states were not made by the model at {model}: " + "; ".join(changes)]


def main_verify(args) -> int:
    res = finalize_output(args.output) if getattr(args, "finalize", False) else verify_output(args.output)
    if getattr(args, "model", None):
        res["problems"] = res["problems"] + model_problems(args.output, args.model)
        res["ok"] = res["ok"] and not res["problems"]
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for line in res["problems"]:
            print(f"BAD  {line}")
        for name in res.get("unrecorded", []):
            print(
                f"NOTE {name}: on disk but not yet in checksums.jsonl (written as the run stopped): the next run writes it again"
            )
        head = "OK" if res["ok"] and res["complete"] else "FAILED" if not res["ok"] else "INCOMPLETE"
        print(f"{head}: {res['checked']} files checked against {res['source']}, {len(res['problems'])} problem(s)")
        if res["ok"] and not res["complete"]:
            if res.get("ranks"):
                w = res["world_size"]
                for r in res["ranks"]:
                    if r["missing"]:
                        print(
                            f"INCOMPLETE: rank {r['rank']} of {w}: {len(r['missing'])} sample(s) have no file yet "
                            f"(indices {_ranges(r['missing'])}): run extract with --rank {r['rank']} "
                            f"--world-size {w} (the same settings) to complete it"
                        )
                    elif not r["done"]:
                        print(
                            f"INCOMPLETE: rank {r['rank']} of {w} has every file but did not finish (no "
                            f"rank_{r['rank']}/done.json): rerun it, or seal the dataset with verify --finalize"
                        )
                if not res["missing"]:
                    print(
                        "INCOMPLETE: every sample has its file, but no manifest.json yet: verify --finalize writes it"
                    )
            elif res["missing"]:
                print(
                    f"INCOMPLETE: {len(res['missing'])} of {res['expected']} samples have no file yet "
                    f"(indices {_ranges(res['missing'])}); the run has not finished: run the same extract "
                    "command again to complete it"
                )
            else:
                print(
                    "INCOMPLETE: every sample has its file, but the run has not finished (no manifest.json): "
                    "run the same extract command again to finish it, or verify --finalize"
                )
    return 1 if not res["ok"] else 0 if res["complete"] else 3

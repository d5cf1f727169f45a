"""``speculators-compat verify OUTPUT``: check an extraction's files against its manifest.

Reads ``manifest.json`` (or, for a run that has not finished, ``checksums.jsonl``) and checks that
every listed file exists with the listed size and checksum (whichever algorithm the record names:
crc32 or sha256; a record without one is checked for size only). Data files on disk that the
list lacks are reported too. Reads each file once, in 8 MiB pieces; no torch needed.
"""
from __future__ import annotations

import json
from pathlib import Path

from .shards import SHARD_FILE_RE
from .writer import CHECKSUMS, DATA_FILE_RE, OutputDir, file_digest


def verify_output(root: str | Path) -> dict:
    """{"source", "checked", "problems": [str], "ok"} for the output directory ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no output directory at {root}")
    manifest = root / "manifest.json"
    if manifest.exists():
        source, records = "manifest.json", json.loads(manifest.read_text())["files"]
    elif (root / "checksums.jsonl").exists():  # (a torn last line: that file shows up as unlisted)
        by_index = OutputDir(root).checksum_records()
        source, records = "checksums.jsonl", [by_index[i] for i in sorted(by_index)]
    else:
        raise FileNotFoundError(f"{root} has neither manifest.json nor checksums.jsonl: not an extract output")
    problems = []
    listed = set()
    for rec in records:
        name = rec["file"]
        listed.add(name)
        p = root / name
        if not p.exists():
            problems.append(f"{name}: missing")
            continue
        size = p.stat().st_size
        if size != rec["bytes"]:
            problems.append(f"{name}: {size} bytes, listed as {rec['bytes']}")
            continue
        algo = next((k for k in CHECKSUMS if k in rec), None)
        if algo is not None and file_digest(p, algo) != rec[algo]:
            problems.append(f"{name}: {algo} differs from the listed {rec[algo]} (the file changed or is corrupt)")
    for p in sorted(root.iterdir()):
        if (DATA_FILE_RE.match(p.name) or SHARD_FILE_RE.match(p.name)) and p.name not in listed:
            problems.append(f"{p.name}: on disk but not listed in {source}")
    return {"source": source, "checked": len(records), "problems": problems, "ok": not problems}


def main_verify(args) -> int:
    res = verify_output(args.output)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for line in res["problems"]:
            print(f"BAD  {line}")
        print(f"{'OK' if res['ok'] else 'FAILED'}: {res['checked']} files checked against {res['source']}, "
              f"{len(res['problems'])} problem(s)")
    return 0 if res["ok"] else 1

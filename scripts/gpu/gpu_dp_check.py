#!/usr/bin/env python3
"""On a GPU: the same mixed-length input extracted by one engine and by two data-parallel engines
sharing GPU 0 (``run_data_parallel(devices=[["0"], ["0"]])``); prints and writes
OUT/dp_check.json: how many data files (and the manifest) are byte-identical, and each run's
self-check counts.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/gpu_dp_check.py /dev/shm/dpc
"""

import hashlib
import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    from speculators_compat.pipeline.extract import run_extract
    from speculators_compat.pipeline.scale.parallel import run_data_parallel
    from speculators_compat.testing import models

    path = str(models.build("llama-1b"))
    inp = out / "in.jsonl"
    lens = [(37 * i) % 1500 + 20 for i in range(96)]
    with open(inp, "w") as f:
        for ids in models.random_prompts(lens, seed=21):
            f.write(json.dumps({"input_ids": ids}) + "\n")
    kw = dict(batch_size=16, dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=4096, progress=False)
    a = run_extract(path, str(inp), str(out / "one"), gpu_memory_utilization=0.4, **kw)
    b = run_data_parallel(
        path, str(inp), str(out / "dp"), data_parallel_size=2, devices=[["0"], ["0"]], gpu_memory_utilization=0.35, **kw
    )

    def files(d):
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.iterdir())
            if p.name.startswith("data_") or p.name == "manifest.json"
        }

    fa, fb = files(out / "one"), files(out / "dp")
    same = [n for n in fa if fb.get(n) == fa[n]]
    res = {
        "files": len(fa),
        "identical": len(same),
        "differ": sorted(set(fa) ^ set(same)),
        "one_engine_self_check": a["self_check"],
        "dp_self_check": b["self_check"],
        "dataset_complete": b["dataset_complete"],
        "engines": b["engines"],
    }
    print("DPCHECK", json.dumps(res))
    (out / "dp_check.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

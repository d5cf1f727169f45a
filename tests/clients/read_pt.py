"""Read ``data_{i}.pt`` files with an installed speculators release's own dataset class, WITHOUT
importing speculators_compat: what a trainer that never heard of us sees.

    python tests/clients/read_pt.py --data DIR

Prints one ``READ {json}`` line: the samples read, or the error the first read raised.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    a = ap.parse_args()
    from speculators.train import data as sd

    out = {"compat_imported": "speculators_compat" in sys.modules}
    try:  # (its constructor already reads the first file, for the lengths)
        dataset = sd.Eagle3SampleFileDataset(file_list=sorted(sd.list_files(a.data)), max_len=512)
        out["read"] = [list(dataset[i]["hidden_states"].shape) for i in range(len(dataset))]
    except Exception as e:  # what the trainer would die of, reported
        out["error"] = f"{type(e).__name__}: {e}"
    out["compat_imported_after"] = "speculators_compat" in sys.modules
    print("READ " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""A format of its own, in one module: numpy's .npz, one ``toy_{i}.npz`` a sample, states kept as
float32. Importing it registers it; ``extract``, ``verify``, resume and ``plan`` then take
``--format toy-npz`` (test_toy_format.py)."""

import io
from pathlib import Path

import numpy as np

from speculators_compat.files.registry import Format, register


def serialise(sample: dict) -> bytes:
    arrays = {"input_ids": sample["input_ids"].numpy(), "loss_mask": sample["loss_mask"].numpy()}
    for j, h in enumerate(sample["hidden_states"]):
        arrays[f"layer_{j}"] = h.float().numpy()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def read(path: Path) -> dict:
    import torch

    with np.load(path) as z:
        n = sum(1 for k in z.files if k.startswith("layer_"))
        return {
            "input_ids": torch.from_numpy(z["input_ids"]),
            "loss_mask": torch.from_numpy(z["loss_mask"]),
            "hidden_states": [torch.from_numpy(z[f"layer_{j}"]) for j in range(n)],
        }


TOY = register(Format("toy-npz", "toy", "npz", serialise, read))

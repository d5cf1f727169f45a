"""speculators 0.3.x / 0.4.x ``scripts/data_generation_offline.py``, as a minimal driver.

The script is in neither release's wheel nor sdist, so it cannot be fetched in a test set-up; this
driver makes the same library calls in the same way, on an installed release (put it first on
PYTHONPATH), after ``import speculators_compat`` unless SPECULATORS_COMPAT_DISABLE=1:
  * resume point: one past the highest ``data_{i}.pt`` in the output directory; 0.4.x also
    reloads ``sample_lengths.json`` when resuming;
  * ``VllmHiddenStatesGenerator(model_path=, layer_ids=, max_model_len=seq_length,
    gpu_memory_utilization=, tensor_parallel_size=)``;
  * for each batch ``dataset[i:i + batch_size]``: ``generate(batch["input_ids"])``, then result
    ``j`` is saved as ``data_{file_idx}.pt`` with ``loss_mask = batch["loss_mask"][j][:len(input_ids)]``
    (``torch.save`` on a thread pool); 0.4.x records ``sample_lengths[str(file_idx)] = len(input_ids)``
    and writes ``sample_lengths.json`` at the end;
  * ``data_config.json`` from ``DataGenerationConfig.from_generator``.
What the script does before that (``load_and_preprocess_dataset``: chat template, tokenizing) is
replaced by ``--dataset``, a ``datasets.save_to_disk`` directory of ``input_ids``/``loss_mask``
rows (the tiny test tokenizer has no chat template); the script's dataset is that, in torch format.

    python tests/clients/offline_script.py --model M --dataset D --output-dir O [--batch-size 8]

``COMPAT_TEST_STUB_CUDA_MEMORY=1`` answers 0.4.x's one CUDA-only call (free memory at start) on a
machine without a GPU, so that its unpatched code can be seen to run; on such a machine 0.4.x's
device-name query for ``data_config.json`` is answered as a CPU-only torch answers it.
Prints ``DRIVER {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def resume_point(out: Path) -> int:
    idx = [int(p.stem[5:]) for p in out.glob("data_*.pt") if p.stem[5:].isdigit()] if out.exists() else []
    return max(idx, default=-1) + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None)
    a = ap.parse_args()

    if os.environ.get("SPECULATORS_COMPAT_DISABLE") != "1":
        import speculators_compat  # noqa: F401  (the user's one added line)
    from importlib.metadata import version

    import torch
    from datasets import load_from_disk
    from speculators.data_generation import vllm_hidden_states_generator as vg
    from speculators.data_generation.config_generator import DataGenerationConfig
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    if os.environ.get("COMPAT_TEST_STUB_CUDA_MEMORY") == "1" and hasattr(vg, "mem_get_info"):
        vg.mem_get_info = lambda: (8 << 30, 16 << 30)
    from speculators.data_generation import config_generator

    if not torch.cuda.is_available() and hasattr(config_generator, "get_device_name"):
        # 0.4.x's data_config.json asks the accelerator for its name, which a CUDA build of torch
        # on a machine without a GPU answers with an error: answer as a CPU-only torch does
        config_generator.get_device_name = lambda idx: "NO ACCELERATOR"
    release = version("speculators")
    keeps_lengths = not release.startswith("0.3.")  # (0.4.x writes sample_lengths.json)

    dataset = load_from_disk(a.dataset).with_format("torch")
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = resume_point(out)
    lengths_file = out / "sample_lengths.json"
    lengths = json.loads(lengths_file.read_text()) if keeps_lengths and start > 0 and lengths_file.exists() else {}
    result = {"speculators": release, "resumed_at": start, "saved": 0}
    if start >= len(dataset):
        print("DRIVER " + json.dumps(result), flush=True)
        return
    gen = VllmHiddenStatesGenerator(
        model_path=a.model,
        layer_ids=a.layer_ids,
        max_model_len=a.seq_length,
        gpu_memory_utilization=0.8,
        tensor_parallel_size=1,
    )
    file_idx = start
    with ThreadPoolExecutor(max_workers=4) as pool:
        saves = []
        for i in range(start, len(dataset), a.batch_size):
            batch = dataset[i : min(i + a.batch_size, len(dataset))]
            results = gen.generate(batch["input_ids"])
            for j, r in enumerate(results):
                n = len(r["input_ids"])
                if keeps_lengths:
                    lengths[str(file_idx)] = n
                sample = {
                    "input_ids": r["input_ids"],
                    "hidden_states": [h.contiguous() for h in r["hidden_states"]],
                    "loss_mask": batch["loss_mask"][j][:n],
                }
                saves.append(pool.submit(torch.save, sample, out / f"data_{file_idx}.pt"))
                file_idx += 1
        for f in saves:
            f.result()
    if keeps_lengths:
        lengths_file.write_text(json.dumps(lengths, indent=2))
    cfg = DataGenerationConfig.from_generator(
        generator=gen,
        train_data_path=a.dataset,
        seq_length=a.seq_length,
        cache_dir="",
        num_samples=len(dataset),
        max_samples=None,
        seed=0,
    )
    (out / "data_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    result["saved"] = file_idx - start
    print("DRIVER " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

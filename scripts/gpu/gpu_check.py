#!/usr/bin/env python3
"""GPU correctness run (docs/results/h200-*-correctness-*.json): unmodified speculators 0.3.0 + import, and the drop-in
generator, on real CUDA vLLM, against HF transformers (float32) on the same GPU.

  1. upstream class + `import speculators_compat`, tiny Llama, async `disable` then `keep`;
  2. drop-in generator, ~1.1B Llama-shaped model in bf16, async `keep` (vLLM auto-enables it on GPU),
     max_num_batched_tokens 2048 so long prompts are chunked.
Cases: 13 mixed prompts (5..700 tokens), prompts sharing a 300-token prefix, the same batch twice,
11 x 900 tokens (two steps / chunked prefill).
  3. the extract pipeline on that engine with the GPU defaults (writer processes reading the rows the
     engine lends out of its page-locked arena, filled by device-to-host copies on a side stream):
     96 samples of 5..2,000 tokens in batches of 16, every file read back and compared with HF, and
     its input_ids and loss_mask with the input. A row written before its copy landed, or from the
     wrong slab or offset, fails here; the CPU tests cannot reach that path (no DMA on CPU).
Writes result.json into the given directory.
"""

import json
import os
import sys
import time


def pipeline_files_vs_hf(gen, path, layers, work, device="cuda", n=96, batch=16, vocab=1024) -> dict:
    """Run the extract pipeline over ``n`` mixed-length samples with ``gen`` and compare every file
    it wrote with the HF reference (per sample, per layer) and with its input."""
    import shutil

    import torch

    from speculators_compat.pipeline.extract import run_extract
    from speculators_compat.pipeline.output.verify import verify_output
    from speculators_compat.testing import models, reference

    lengths = [(37 * i * i + 5) % 2000 + 5 for i in range(n)]  # 5..2004: some span several steps
    prompts = [[t % vocab for t in p] for p in models.random_prompts(lengths, seed=21)]
    masks = [[(j + i) % 3 != 0 for j in range(len(p))] if i % 2 else None for i, p in enumerate(prompts)]
    os.makedirs(work, exist_ok=True)
    jsonl, outdir = os.path.join(work, "in.jsonl"), os.path.join(work, "out")
    shutil.rmtree(outdir, ignore_errors=True)
    with open(jsonl, "w") as f:
        for p, m in zip(prompts, masks):
            f.write(json.dumps({"input_ids": p, **({"loss_mask": [int(x) for x in m]} if m else {})}) + "\n")
    t = time.time()
    s = run_extract(path, jsonl, outdir, batch_size=batch, generator=gen, progress=False)
    info = {
        "samples": n,
        "tokens": sum(lengths),
        "seconds": round(time.time() - t, 2),
        "writer": s["writer"],
        "files_by_writer_processes": s.get("files_by_writer_processes"),
        "files": s["files"],
    }
    refs = reference.HFReference(path, layers, device=device)
    tol = None
    bad_ids, mismatches, worst = [], [], 0.0
    for i, (p, m) in enumerate(zip(prompts, masks)):
        d = torch.load(os.path.join(outdir, f"data_{i}.pt"), weights_only=True)
        want_mask = [int(x) for x in m] if m else [1] * len(p)
        if d["input_ids"].tolist() != p or d["loss_mask"].tolist() != want_mask:
            bad_ids.append(i)
        tol = tol or reference.tolerance_for(d["hidden_states"][0].dtype)
        w, bad = reference.compare([d["hidden_states"]], [p], refs, tol)
        worst = max(worst, w)
        mismatches += [dict(vars(b), seq=i) for b in bad]
    del refs
    info.update(
        {
            "tolerance": tol,
            "worst_rel": worst,
            "ids_or_mask_wrong": bad_ids[:5],
            "mismatches": mismatches[:5],
            "verify": verify_output(outdir),
        }
    )
    info["ok"] = not bad_ids and not mismatches and s["files"] == n and info["verify"].get("ok", False)
    shutil.rmtree(outdir, ignore_errors=True)
    return info


def main() -> int:
    out = sys.argv[1]
    import torch

    import speculators_compat  # first, as a user would
    from speculators_compat import VllmHiddenStatesGenerator, versions
    from speculators_compat.testing import models, reference

    report = {"gpu": torch.cuda.get_device_name(0), "versions": versions.report(), "runs": []}
    tiny, big = str(models.build("llama")), str(models.build("llama-1b"))
    prefix = models.random_prompts([300], seed=11)[0]
    cases = {
        "mixed13": models.random_prompts([5, 700, 37, 120, 300, 17, 64, 8, 512, 50, 99, 10, 11], seed=1),
        "shared_prefix": [prefix + t for t in models.random_prompts([5, 40, 77], seed=12)] + [prefix],
        "chunked_11x900": models.random_prompts([900] * 11, seed=5),
    }

    def run(name, gen, path, layers, vocab=1024):
        refs = reference.HFReference(path, layers, device="cuda")
        eng = getattr(gen, "engine", None) or gen._compat_engine
        eng.self_check = True  # (opt-in in the generators): every case below is checked too
        info = {
            "name": name,
            "model": os.path.basename(path),
            "async_scheduling": eng.vllm_config.scheduler_config.async_scheduling,
            "batch_queue": eng.core.batch_queue is not None,
            "worker_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
            "runner": eng.model_info.get("runner"),
            "runner_kind": eng.model_info.get("runner_kind"),
            "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
            "startup_s": round(eng.startup_seconds, 1),
            "cases": {},
        }
        for cname, prompts in list(cases.items()) + [("repeat_mixed13", cases["mixed13"])]:
            prompts = [[t % vocab for t in p] for p in prompts]
            t = time.time()
            res = gen.generate(prompts)
            dt = time.time() - t
            dtype = res[0]["hidden_states"][0].dtype
            order_ok = all(r["input_ids"].tolist() == p for r, p in zip(res, prompts))
            worst, bad = reference.compare(
                [r["hidden_states"] for r in res], prompts, refs, reference.tolerance_for(dtype)
            )
            info["cases"][cname] = {
                "ok": order_ok and not bad,
                "worst_rel": worst,
                "dtype": str(dtype),
                "tokens": sum(map(len, prompts)),
                "seconds": round(dt, 3),
                "mismatches": [vars(b) for b in bad[:3]],
            }
            print(name, cname, info["cases"][cname], flush=True)
        info["self_check"] = eng.self_check_stats.as_dict() if eng.self_check else None
        info["cases"]["self_check"] = {"ok": bool(info["self_check"]) and info["self_check"]["failed"] == 0}
        del refs
        torch.cuda.empty_cache()
        report["runs"].append(info)

    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator as Upstream

    g = Upstream(tiny, layer_ids=[1, 3, 5], max_model_len=2048, gpu_memory_utilization=0.3)
    run("upstream+import", g, tiny, [1, 3, 5])  # (vLLM's own choice: async scheduling on)
    g.__del__()
    with VllmHiddenStatesGenerator(
        tiny, layer_ids=[1, 3, 5], max_model_len=2048, gpu_memory_utilization=0.3, async_scheduling="disable"
    ) as g:
        run("drop-in tiny async=disable", g, tiny, [1, 3, 5])
    with VllmHiddenStatesGenerator(
        big,
        max_model_len=4096,
        dtype="bfloat16",
        gpu_memory_utilization=0.4,
        max_num_batched_tokens=2048,
        async_scheduling="keep",
    ) as g:
        run("drop-in llama-1b bf16 async=keep", g, big, g.layer_ids, vocab=32000)
        work = os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu-check-pipeline")
        p = pipeline_files_vs_hf(g, big, g.layer_ids, work)
        p["ok"] = p["ok"] and p["writer"] == "process" and (p["files_by_writer_processes"] or 0) > 0
        print("pipeline files vs HF", json.dumps(p, default=str), flush=True)
        report["pipeline"] = p
    report["status"] = speculators_compat.status()
    report["all_ok"] = all(c["ok"] for r in report["runs"] for c in r["cases"].values()) and report["pipeline"]["ok"]
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("ALL OK" if report["all_ok"] else "MISMATCHES", flush=True)
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Kimi-K2.5-shaped extraction on one or more GPUs (the multi-GPU issue).

Builds, on the GPU, a random-weight DeepSeek-V3-architecture model at Kimi-K2.5's width (hidden 7168,
MLA q_lora 1536 / kv_lora 512 / 64 heads / qk_nope 128 / qk_rope 64 / v 128, vocab 163840, top-8
routing with one shared expert) but few layers and experts (default 3 layers: 1 dense + 2 MoE, 16
experts) in bf16 (no INT4 tooling on that machine). For each tensor-parallel size in --tp it runs
the drop-in generator, compares every captured layer with HF transformers (float32, GPU 0) and with
the first TP size's states, and measures tokens/s on a 16 x 1024-token batch (self-check on and off, alternating).
--pipeline: the extract CLI at the largest TP size writing to local disk; a second run has one
worker killed mid-run (must stop within 60 s, completed files intact), then resumes; the resumed
dataset must be byte-identical to the uninterrupted one.
--kimi-k25: the same text model inside Kimi-K2.5's multimodal wrapper (KimiK25ForConditionalGeneration,
speculators_compat/testing/kimi.py), loaded with trust_remote_code; --int4 G: its routed experts as
compressed-tensors INT4 (pack-quantized, group G; Kimi-K2.5 uses 32); the HF reference then runs
the dequantized weights, which is what the engine computes with.
    python scripts/gpu/gpu_kimi_shaped.py OUTDIR [--tp 1,2] [--pipeline] [--layers 3] [--experts 16]
                                      [--kimi-k25 [--int4 32]]
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path


def build(path, layers, experts, width, vocab):
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=int(width * 18432 / 7168),
        moe_intermediate_size=int(width * 2048 / 7168),
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        max_position_embeddings=8192,
        rope_theta=50000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.02,
    )
    cfg = DeepseekV3Config(**kw)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20GB")
    from speculators_compat.testing.models import save_tokenizer

    save_tokenizer(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return n


@contextlib.contextmanager
def _upstream(up):
    """Upstream's generator as a context: ``.engine`` is the import's engine; shut down after."""
    up.engine = up._compat_engine
    try:
        yield up
    finally:
        up._compat_engine.shutdown()


def tp_entry(x: str) -> tuple[int, bool]:
    """'2' -> (2, False); '2ep' -> (2, True): tensor-parallel size, expert parallelism."""
    return int(x.removesuffix("ep")), x.endswith("ep")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--width", type=int, default=7168)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument(
        "--tp",
        default="1",
        help="comma-separated tensor-parallel sizes, e.g. 1,2; a size "
        "ending in 'ep' (4ep) also enables expert parallelism",
    )
    ap.add_argument("--pipeline", action="store_true", help="only the pipeline + killed-worker check")
    ap.add_argument("--kimi-k25", action="store_true", help="inside the Kimi-K2.5 multimodal wrapper")
    ap.add_argument(
        "--upstream",
        action="store_true",
        help="run speculators 0.3.0's own generator (patched by the import) instead of ours",
    )
    ap.add_argument(
        "--int4",
        type=int,
        default=0,
        metavar="GROUP",
        help="with --kimi-k25: routed experts as compressed-tensors INT4 with this group size",
    )
    a = ap.parse_args()
    if a.int4 and not a.kimi_k25:
        ap.error("--int4 needs --kimi-k25")
    os.makedirs(a.out, exist_ok=True)
    report = {"layers": a.layers, "experts": a.experts, "width": a.width}
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kimi-shaped-{a.layers}l-{a.experts}e-{a.width}")
    t = time.time()
    if not os.path.exists(os.path.join(path, "config.json")):
        report["params"] = build(path, a.layers, a.experts, a.width, a.vocab)
    report["build_s"] = round(time.time() - t, 1)
    a.ref_path = path
    if a.kimi_k25:
        from speculators_compat.testing import kimi

        tag = f"-int4g{a.int4}" if a.int4 else ""
        wrapped, a.ref_path = path + "-k25" + tag, (path + "-deq" + tag if a.int4 else path)
        t = time.time()
        if not os.path.exists(os.path.join(wrapped, "config.json")):
            kimi.wrap(path, wrapped + ".tmp", int4_group=a.int4 or None, ref_dir=a.ref_path if a.int4 else None)
            os.replace(wrapped + ".tmp", wrapped)
        report.update(
            wrap_s=round(time.time() - t, 1),
            wrapper="KimiK25ForConditionalGeneration",
            int4_group=a.int4 or None,
            checkpoint_gib=round(sum(f.stat().st_size for f in Path(wrapped).glob("*.safetensors")) / 2**30, 2),
        )
        path = wrapped
    print(json.dumps(report), flush=True)
    if a.build_only:
        return 0
    if a.pipeline:
        return pipeline_check(a, path, report)
    import statistics

    import torch

    import speculators_compat  # noqa: F401
    from speculators_compat import VllmHiddenStatesGenerator
    from speculators_compat.testing import models, reference

    layer_ids = list(range(a.layers))
    prompts = [
        [t % a.vocab for t in p] for p in models.random_prompts([5, 700, 37, 1500, 120, 64], seed=1, vocab=a.vocab)
    ]
    bench = models.random_prompts([1024] * 16, seed=2, vocab=a.vocab)
    tps = a.tp.split(",")
    results, runs = {}, {}
    for tp in tps:
        r = {}
        t = time.time()
        if a.upstream:  # speculators 0.3.0's own class, patched by the import (its arguments only)
            from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator as Up

            cm = _upstream(
                Up(
                    path,
                    layer_ids=layer_ids,
                    max_model_len=4096,
                    gpu_memory_utilization=0.5,
                    tensor_parallel_size=tp_entry(tp)[0],
                )
            )
        else:
            cm = VllmHiddenStatesGenerator(
                path,
                layer_ids=layer_ids,
                max_model_len=4096,
                dtype="bfloat16",
                tensor_parallel_size=tp_entry(tp)[0],
                gpu_memory_utilization=0.5,
                enable_expert_parallel=tp_entry(tp)[1],
                max_num_batched_tokens=1024,
                trust_remote_code=a.kimi_k25,
            )
        with cm as g:
            r["engine_start_s"] = round(time.time() - t, 1)
            r["model_class"] = g.engine.model_info
            g.engine.self_check = True  # (opt-in in the generators)
            g.generate(prompts)  # warm-up (MoE kernels compile on first use)
            t = time.time()
            results[tp] = g.generate(prompts)
            r["generate_s"] = round(time.time() - t, 3)
            g.generate(bench)
            times, unchecked = [], []  # the self-check on and off, alternating
            for i in range(6):
                g.engine.self_check = i % 2 == 0
                t = time.perf_counter()
                g.generate(bench)
                (times if i % 2 == 0 else unchecked).append(time.perf_counter() - t)
            g.engine.self_check = True
            r["bench_tok_s_median"] = round(16 * 1024 / statistics.median(times))
            r["bench_tok_s_spread"] = [round(16 * 1024 / max(times)), round(16 * 1024 / min(times))]
            r["bench_tok_s_unchecked_median"] = round(16 * 1024 / statistics.median(unchecked))
            r["self_check_cost"] = round(1 - statistics.median(unchecked) / statistics.median(times), 4)
            r["self_check"] = g.engine.self_check_stats.as_dict()
            r["self_check_worker_s"] = g.engine.stats()["self_check_s"]
        r["order_ok"] = all(x["input_ids"].tolist() == p for x, p in zip(results[tp], prompts))
        # routed experts on rank 0: all of them under plain TP, 1/TP of them under expert parallelism
        size, ep = tp_entry(tp)
        r["moe_local_experts_expected"] = a.experts // size if ep else a.experts
        r["experts_ok"] = r["model_class"].get("moe_local_experts") == r["moe_local_experts_expected"]
        if a.kimi_k25:
            r["experts_ok"] = r["experts_ok"] and r["model_class"].get("model") == "KimiK25ForConditionalGeneration"
        runs[tp] = r
        print(json.dumps({"tp": tp, **r}, default=str), flush=True)
    report["tokens"] = sum(map(len, prompts))
    ref = reference.HFReference(a.ref_path, layer_ids, device="cuda" if torch.cuda.is_available() else "cpu")
    ok = True
    for tp in tps:
        worst, bad = reference.compare(
            [x["hidden_states"] for x in results[tp]], prompts, ref, reference.TOLERANCE["bfloat16"]
        )
        per_layer = {}
        for x, p in zip(results[tp], prompts):
            for j, lid in enumerate(layer_ids):
                w = ref(p)[j]
                e = float((x["hidden_states"][j].float().cpu() - w).norm() / w.norm())
                per_layer[lid] = max(per_layer.get(lid, 0.0), e)
        runs[tp].update({"worst_rel_vs_hf": worst, "per_layer_worst_rel": per_layer, "mismatches": len(bad)})
        ok = ok and not bad and runs[tp]["order_ok"] and runs[tp]["experts_ok"]
        if tp != tps[0]:  # against the first TP size, directly
            rel = max(
                float((x.float() - y.float()).norm() / y.float().norm())
                for a_, b_ in zip(results[tp], results[tps[0]])
                for x, y in zip(a_["hidden_states"], b_["hidden_states"])
            )
            runs[tp][f"worst_rel_vs_tp{tps[0]}"] = rel
            ok = ok and rel <= reference.TOLERANCE["bfloat16"]
    report.update({"runs": runs, "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()})
    print(json.dumps(report, default=str), flush=True)
    name = ("kimi_k25" + (f"_int4g{a.int4}" if a.int4 else "") if a.kimi_k25 else "kimi_shaped") + (
        "_upstream" if a.upstream else ""
    )
    with open(os.path.join(a.out, f"{name}_tp{a.tp.replace(',', '-')}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    return 0 if ok else 1


def _read_dir(d):
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).glob("data_*.pt"))}


def pipeline_check(a, path, report) -> int:
    """The extract CLI at TP=max(--tp): uninterrupted run, killed run, resume, byte-identical."""
    import signal
    import subprocess

    import psutil

    from speculators_compat.testing import models

    entries = [tp_entry(x) for x in a.tp.split(",")]
    tp = max(size for size, _ in entries)
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), "kimi-pipeline")
    os.makedirs(work, exist_ok=True)
    jsonl = os.path.join(work, "in.jsonl")
    prompts = models.random_prompts([700, 1500, 300, 1024, 64, 900] * 16, seed=5, vocab=a.vocab)
    with open(jsonl, "w") as f:
        for p in prompts:
            f.write(json.dumps({"input_ids": p}) + "\n")
    args = [
        sys.executable,
        "-m",
        "speculators_compat.cli",
        "extract",
        "--model",
        path,
        "--input",
        jsonl,
        "--tensor-parallel-size",
        str(tp),
        "--batch-size",
        "8",
        "--max-model-len",
        "4096",
        "--dtype",
        "bfloat16",
        "--max-num-batched-tokens",
        "4096",
        "--gpu-memory-utilization",
        "0.5",
        "--layer-ids",
        ",".join(str(i) for i in range(a.layers)),
        "--no-progress",
    ]
    if a.kimi_k25:
        args.append("--trust-remote-code")
    ep = any(e for _, e in entries)
    if ep:
        args.append("--enable-expert-parallel")
    r = {"tp": tp, "expert_parallel": ep, "samples": len(prompts), "tokens": sum(map(len, prompts))}
    ref_out, out = os.path.join(work, "ref"), os.path.join(work, "run")
    t = time.time()
    ref = subprocess.run(args + ["--output", ref_out], capture_output=True, text=True)
    r["uninterrupted_s"] = round(time.time() - t, 1)
    r["uninterrupted_summary"] = [ln for ln in ref.stdout.splitlines() if ln.startswith("summary:")]
    if ref.returncode != 0:
        print(ref.stdout[-3000:], ref.stderr[-5000:])
        return 1
    p = subprocess.Popen(args + ["--output", out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while (
        p.poll() is None
        and len([f for f in os.listdir(out) if f.startswith("data_")] if os.path.isdir(out) else []) < 24
    ):
        time.sleep(0.2)
    workers = []
    for c in psutil.Process(p.pid).children(recursive=True):
        try:
            if "VLLM::Worker" in " ".join(c.cmdline()) or "VllmWorker" in c.name():  # vLLM retitles them
                workers.append(c)
        except psutil.Error:
            continue
    r["workers_seen"] = len(workers)
    if p.poll() is not None or not workers:
        print("could not kill a worker mid-run:", p.poll(), p.stdout.read()[-3000:])
        return 1
    os.kill(workers[-1].pid, signal.SIGKILL)
    t = time.time()
    try:
        log, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        p.kill()
        r["stopped_after_kill_s"] = None
        print(json.dumps(r))
        return 1
    r["stopped_after_kill_s"] = round(time.time() - t, 1)
    r["killed_rc"] = p.returncode
    r["error_named"] = "worker process died" in log
    done = [f for f in os.listdir(out) if f.startswith("data_")]
    r["files_at_kill"] = len(done)
    import torch

    r["files_intact"] = all(torch.load(os.path.join(out, f), weights_only=True) is not None for f in done)
    t = time.time()
    again = subprocess.run(args + ["--output", out], capture_output=True, text=True)
    r["resume_s"] = round(time.time() - t, 1)
    r["resume_rc"] = again.returncode
    r["byte_identical"] = _read_dir(out) == _read_dir(ref_out) and len(_read_dir(ref_out)) == len(prompts)
    # the uninterrupted run's files against HF (every layer of the first 12 samples)
    from speculators_compat.testing import reference

    layer_ids = list(range(a.layers))
    hf = reference.HFReference(a.ref_path, layer_ids, device="cuda" if torch.cuda.is_available() else "cpu")
    files = [torch.load(os.path.join(ref_out, f"data_{i}.pt"), weights_only=True) for i in range(12)]
    worst, bad = reference.compare(
        [f["hidden_states"] for f in files], prompts[:12], hf, reference.TOLERANCE["bfloat16"]
    )
    r.update(
        files_vs_hf_worst_rel=worst,
        files_vs_hf_mismatches=len(bad),
        files_ids_ok=all(f["input_ids"].tolist() == p for f, p in zip(files, prompts)),
    )
    report["pipeline"] = r
    print(json.dumps(report, default=str), flush=True)
    name = "kimi_k25" + (f"_int4g{a.int4}" if a.int4 else "") if a.kimi_k25 else "kimi"
    with open(os.path.join(a.out, f"{name}_pipeline_tp{tp}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    ok = (
        r["byte_identical"]
        and r["error_named"]
        and r["stopped_after_kill_s"] < 60
        and r["files_intact"]
        and not bad
        and r["files_ids_ok"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

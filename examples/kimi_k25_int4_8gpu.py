#!/usr/bin/env python3
"""Recipe: EAGLE-3 training data from Kimi-K2.5 INT4 on one 8-GPU node (e.g. 8x H200, 141 GB each).

    python examples/kimi_k25_int4_8gpu.py --model /models/Kimi-K2.5 --input train.jsonl --output /data/kimi-hs

What each setting is for:
  * tensor_parallel_size=8: ~595 GB of INT4 weights (routed experts int4 g32, the rest bf16) ->
    ~77 GB per GPU (run `speculators-compat plan --model ... --tensor-parallel-size 8` first);
  * trust_remote_code=True: Kimi-K2.5's config/tokenizer classes ship inside the checkpoint;
  * dtype="auto": bf16 activations; quantization is read from the checkpoint (compressed-tensors);
  * layer ids [2, 30, 58, 60] (upstream convention = vLLM native EAGLE-3 [3, 31, 59, 61]): the last
    one (60) is the verifier's final pre-norm state, which speculators' trainer uses as target;
  * max_num_batched_tokens=8192: tokens per prefill step; with 4 captured layers x 7168 x 2 B the
    capture buffer is 0.45 GiB per step;
  * gpu_memory_utilization=0.85: room to spare. On vLLM 0.17+ extraction is text only (the engine
    passes language_model_only=True: the vision tower is neither built nor profiled); 0.15/0.16
    build and profile it as serving does;
  * VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=1200: cold INT4 MoE kernels can stall the first step;
  * enable_expert_parallel: optional (--ep). Tested on H200s with a Kimi-width 3-layer model: plain
    TP=1 and 2, and TP=2 with EP (HF-exact within bf16 tolerance, killed-worker resume
    byte-identical; docs/kimi-k25.md), and at TP=1 in Kimi-K2.5's own
    layout with INT4 group-32 experts; TP=8 has not run;
  * --output on a disk that keeps up: 57.4 MB/s for each 1,000 tokens/s extracted (`plan` prints
    it). Over long runs that disk, not the GPUs, can set the pace (on the H200 test host: 1.2 GiB/s
    against 4.4 GiB/s of states from a 1.1B model); a run that waited on its writers says so.
  * /dev/shm on the host (docker: --ipc=host or a large --shm-size): captured states reach the
    writers through an arena there, page-locked for the GPUs' copies; the pipeline holds up to
    queue_size + 2 batches of them, each slab with 25% headroom. At --batch-size 32 and prompts of
    up to 8,191 tokens that is at most 70.0 GiB; `plan --input train.jsonl --batch-size 32
    --max-model-len 8192` sizes it from the dataset's largest batch.
Resumable: rerun the same command after any interruption. SIGTERM (what a scheduler preempting the
job sends) and SIGHUP shut the engine down like Ctrl-C and exit with 128 + the signal's number. The
samples already written are kept; the ones recomputed can differ slightly from an uninterrupted run's, because vLLM's INT4 MoE kernel
is not bit-for-bit reproducible run to run (measured on vLLM 0.20, docs/kimi-k25.md; both match HF).

It needs the GPUs; everything around it runs on the built-in tiny models on CPU:
    python examples/kimi_k25_int4_8gpu.py --model "$(python -c 'from speculators_compat.testing import models; print(models.build("llama"))')" \
        --input samples.jsonl --output out --tensor-parallel-size 1 --layer-ids 1,3,5 --max-model-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=8)
    ap.add_argument("--layer-ids", default="2,30,58,60")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--ep", action="store_true", help="enable expert parallelism")
    ap.add_argument("--max-samples", type=int, default=None)
    a = ap.parse_args()

    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1200")
    import speculators_compat  # noqa: F401
    from speculators_compat.pipeline.extract import run_extract
    from speculators_compat.signals import handle_termination, interrupted

    handle_termination()  # a preempted job's SIGTERM shuts the 8 workers down like Ctrl-C
    try:
        summary = run_extract(
            a.model,
            a.input,
            a.output,
            layer_ids=[int(x) for x in a.layer_ids.split(",")],
            batch_size=a.batch_size,
            max_samples=a.max_samples,
            max_model_len=a.max_model_len,
            tensor_parallel_size=a.tensor_parallel_size,
            trust_remote_code=True,
            dtype="auto",
            max_num_batched_tokens=a.max_num_batched_tokens,
            gpu_memory_utilization=a.gpu_memory_utilization,
            enable_expert_parallel=a.ep,
            async_scheduling="keep",
        )
    except KeyboardInterrupt as e:
        msg, code = interrupted(e, a.output)
        print(msg, file=sys.stderr)
        return code
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

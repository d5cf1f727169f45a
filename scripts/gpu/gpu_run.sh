#!/usr/bin/env bash
# On a GPU machine where vLLM is installed into $SITE (the ../shared/gpu bundle puts vLLM 0.20.0 in
# /tmp/site): expose this source tree with its vLLM plugin entry point, then run the GPU checks.
#   bash scripts/gpu/gpu_run.sh correctness OUTDIR     # engines vs HF on the GPU, async keep/disable
#   bash scripts/gpu/gpu_run.sh bench OUTDIR [ARGS]    # throughput: raw vLLM, generate, pipeline, vLLM's own
#        extractor and HF on a ~1.1B Llama-shaped model (ARGS to benchmarks/throughput.py, e.g. --batches 16)
#   bash scripts/gpu/gpu_run.sh selfcheck OUTDIR [ARGS] # the self-check's cost (benchmarks/self_check.py ARGS)
#   bash scripts/gpu/gpu_run.sh dp OUTDIR [ARGS]       # one engine against 2 sharing the GPU (benchmarks/data_parallel.py)
#   bash scripts/gpu/gpu_run.sh serve OUTDIR [ARGS]    # serve (vLLM's server + our connector) vs vllm serve's
#        native extractor vs generate() (benchmarks/serve.py ARGS; --long 32768,120000: device memory)
#   bash scripts/gpu/gpu_run.sh kimi OUTDIR [ARGS]     # Kimi-K2.5-width DeepSeek-V3 model, few layers
#        (ARGS to scripts/gpu/gpu_kimi_shaped.py, e.g. --tp 1,2, or --tp 2 --pipeline)
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/site}
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
       VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} TOKENIZERS_PARALLELISM=false
d="$SITE/speculators_compat-0.1.0.dist-info"   # so vLLM finds our vllm.general_plugins entry point
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: speculators-compat\nVersion: 0.1.0\n' > "$d/METADATA"
printf '[vllm.general_plugins]\nspeculators_compat = speculators_compat.plugin:register\n' > "$d/entry_points.txt"
mode=${1:?correctness or bench}; out=${2:?output dir}; shift 2; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [ "$mode" = serve ]; then
  python3 benchmarks/serve.py --model llama-1b --dtype bfloat16 --max-num-batched-tokens 8192 \
      --json "$out/serve.json" "$@" 2>&1 | tee "$out/serve.log" | grep -v "INFO\|WARNING\|it/s\]"
elif [ "$mode" = kimi ]; then
  python3 scripts/gpu/gpu_kimi_shaped.py "$out" "$@" 2>&1 | tee -a "$out/kimi.log" | grep -v "^INFO"
elif [ "$mode" = dp ]; then
  python3 benchmarks/data_parallel.py --json "$out/data_parallel.json" "$@" 2>&1 | tee "$out/data_parallel.log" | grep -v "^INFO"
elif [ "$mode" = selfcheck ]; then
  python3 benchmarks/self_check.py --json "$out/self_check.json" "$@" 2>&1 | tee "$out/self_check.log" | grep -v "^INFO"
elif [ "$mode" = bench ]; then
  python3 benchmarks/throughput.py --model llama-1b --batch 32 --seq 1024 --batches 8 --reps 3 --dtype bfloat16 \
      --max-num-batched-tokens 8192 --gpu-memory-utilization 0.25 --json "$out/bench.json" "$@" 2>&1 \
      | tee "$out/bench.log" | grep -v "^INFO"
else
  python3 scripts/gpu/gpu_check.py "$out" 2>&1 | tee "$out/correctness.log" | grep -v "^INFO"
fi

#!/usr/bin/env bash
# The README's main job: build (or reuse) the default vLLM CPU environment, then run unmodified
# speculators 0.3.0 + `import speculators_compat` on a built-in tiny model and compare every
# captured hidden state with Hugging Face transformers. No GPU, no model hub.
#   SPECULATORS_COMPAT_VLLM=0.16.0 bash scripts/demo.sh   # another vLLM;  DEMO_MODEL=qwen2 for another model
set -euo pipefail
cd "$(dirname "$0")/.."
V="${SPECULATORS_COMPAT_VLLM:-0.32.0}"
python3 scripts/engine_env.py build "$V"
PY=$(python3 scripts/engine_env.py python "$V")
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-ERROR}"
exec "$PY" -m speculators_compat.cli demo --model "${DEMO_MODEL:-llama}"

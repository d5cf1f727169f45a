"""One module per upstream break. ``PATCHES`` is the registry's list, in application order."""

from .speculators04_generator import Speculators04GeneratorPatch
from .speculators_generator import SpeculatorsGeneratorPatch
from .speculators_worker import SpeculatorsWorkerPatch
from .torch_fp8_states import Fp8StatesLoadPatch
from .transformers_compat import AttnMaskUtilsPatch, ConfigTorchPatch
from .vllm_cpu_attention_isa import CpuAttentionIsaPatch
from .vllm_cpu_mla_backend import CpuMlaBackendPatch
from .vllm_kv_cache_names import KVCacheNamesPatch
from .vllm_request import RequestPatch

PATCHES = [
    ConfigTorchPatch(),
    AttnMaskUtilsPatch(),
    RequestPatch(),
    KVCacheNamesPatch(),
    CpuAttentionIsaPatch(),
    CpuMlaBackendPatch(),
    SpeculatorsGeneratorPatch(),
    Speculators04GeneratorPatch(),
    SpeculatorsWorkerPatch(),
    Fp8StatesLoadPatch(),
]


def all_patches() -> list:
    """Every registered patch, in application order."""
    return PATCHES


__all__ = ["PATCHES", "all_patches"]

"""One module per upstream break. ``PATCHES`` is the registry's list, in application order."""
from .speculators_generator import SpeculatorsGeneratorPatch
from .speculators_worker import SpeculatorsWorkerPatch
from .transformers_compat import AttnMaskUtilsPatch, ConfigTorchPatch
from .vllm_request import RequestPatch

PATCHES = [
    ConfigTorchPatch(),
    AttnMaskUtilsPatch(),
    RequestPatch(),
    SpeculatorsGeneratorPatch(),
    SpeculatorsWorkerPatch(),
]

__all__ = ["PATCHES"]

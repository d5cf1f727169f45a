"""``data_{i}.pt`` files of FP8 states, read by speculators 0.3/0.4's own trainers.

Their ``Eagle3SampleFileDataset`` reads each file with ``torch.load(..., weights_only=True)`` and
casts ``hidden_states`` to float: e4m3 values there would be silently wrong (no scale applied). So a
file of FP8 states holds a call of ``engine.fp8.load_fp8_hidden_states`` where the list of layers
would be (engine/fp8.py). This patch lets torch's weights-only loader make that call (the function
joins torch's allow-list of globals) and switches the function on: the trainer gets the dequantized
layers. Without it the load fails, naming the function; after ``unpatch()`` it fails with our
message.
"""

from __future__ import annotations

from ..registry import Patch


class Fp8StatesLoadPatch(Patch):
    name = "torch_load_fp8_states"
    module = "torch"  # (fires once torch is whole; torch.serialization is imported midway through it)
    targets = ("torch.serialization:add_safe_globals",)
    package = "torch"
    versions = ">=2.4"  # (add_safe_globals / get_safe_globals / clear_safe_globals came in 2.4)
    process = "driver"
    risk = "low: torch's public allow-list API for weights-only loading"
    description = (
        "let torch.load(weights_only=True) call speculators_compat's FP8 loader, so that "
        "speculators 0.3/0.4's trainers read data_{i}.pt files of FP8 states as dequantized layers"
    )
    test = (
        "tests/engine/test_speculators_releases.py::test_trainer_on_fp8_extract_output, "
        "tests/test_fp8.py::test_a_pt_file_of_fp8_states_dequantizes_at_load_only_with_the_patch"
    )

    def needed(self, module):
        if not hasattr(module.serialization, "add_safe_globals"):
            return None
        return "data_{i}.pt files of FP8 states dequantize at load"

    def _apply(self, module) -> None:
        from ..engine.fp8 import load_fp8_hidden_states, set_pt_loader

        module.serialization.add_safe_globals([load_fp8_hidden_states])
        set_pt_loader(True)

    def _revert(self, module) -> None:
        from ..engine.fp8 import load_fp8_hidden_states, set_pt_loader

        set_pt_loader(False)
        ser = module.serialization
        keep = [g for g in ser.get_safe_globals() if g is not load_fp8_hidden_states]
        ser.clear_safe_globals()
        ser.add_safe_globals(keep)

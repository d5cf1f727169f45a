"""``data_{i}.pt`` files of FP8 states, read by speculators 0.3/0.4's own trainers.

Their ``Eagle3SampleFileDataset`` reads each file with ``torch.load(..., weights_only=True)`` and
casts ``hidden_states`` to float: e4m3 values there would be silently wrong (no scale applied). So a
file of FP8 states holds a call of ``engine.fp8.load_fp8_hidden_states`` where the list of layers
would be (engine/fp8.py). This patch wraps ``torch.load`` so that torch's weights-only loader may
make that call (the function joins torch's allow-list of globals) and switches the function on: the
trainer gets the dequantized layers. Without it the load fails, naming the function; after
``unpatch()`` it fails with our message.
"""

from __future__ import annotations

from ..registry import Patch


class Fp8StatesLoadPatch(Patch):
    name = "torch_load_fp8_states"
    module = "torch"  # (fires once torch is whole; torch.serialization is imported midway through it)
    targets = ("torch:load",)
    package = "torch"
    versions = ">=2.4"  # (add_safe_globals / get_safe_globals came in 2.4)
    process = "driver"
    risk = "low: wraps torch.load without changing its arguments; torch's public allow-list API"
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

        ser = module.serialization

        def load(wrapped, instance, args, kwargs):
            # (added, never taken off: torch's own context manager would take it off a list that
            # another thread's load may be reading; off, the loader refuses with our message)
            if load_fp8_hidden_states not in ser.get_safe_globals():
                ser.add_safe_globals([load_fp8_hidden_states])
            return wrapped(*args, **kwargs)

        self.wrap(module, "load", load)
        set_pt_loader(True)

    def _revert(self, module) -> None:
        from ..engine.fp8 import set_pt_loader

        set_pt_loader(False)
        self._unwrap_all()

"""speculators 0.3.0 under transformers 5.x (which vLLM >= 0.24 requires).

* ``transformers_config_torch``: ``import speculators`` fails with
  ``PydanticUndefinedAnnotation: name 'torch' is not defined``: speculators builds pydantic
  models over ``PretrainedConfig``, whose annotations say ``"torch.dtype"`` while transformers 5's
  ``configuration_utils`` no longer has ``torch`` in its namespace. Put it back.
* ``transformers_attn_mask_utils``: newer 5.x (present in 5.19, gone by 5.24) removed
  ``transformers.modeling_attn_mask_utils``, which ``speculators.models.eagle`` imports
  ``_prepare_4d_causal_attention_mask`` from. Provide a module with that one function.
Both are needed in workers too when a worker imports speculators (e.g. upstream's worker
extension), so they are marked ``process = "both"`` and reach workers through the vLLM plugin.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

from ..registry import SENTINEL, Patch, PatchTargetError, is_ours

_SHIM = "transformers.modeling_attn_mask_utils"


class ConfigTorchPatch(Patch):
    name = "transformers_config_torch"
    module = "transformers.configuration_utils"
    targets = ("transformers.configuration_utils:torch (module global)",)
    package = "transformers"
    versions = ">=5.0.0.dev0"
    process = "both"
    risk = "low: adds one module global; harmless if transformers restores it"
    description = "speculators' pydantic schemas resolve 'torch.dtype' in configuration_utils' namespace"
    test = "tests/engine/test_patches_engine.py::test_speculators_imports_under_transformers_5"

    def needed(self, module):
        if "torch" in vars(module):
            return None
        return "transformers.configuration_utils has no `torch` global (pydantic forward refs fail)"

    def _apply(self, module):
        try:
            import torch
        except ImportError as e:
            raise PatchTargetError(f"patch {self.name}: torch is not importable: {e}") from e
        module.torch = torch

    def _revert(self, module):
        if module is not None and vars(module).get("torch") is not None:
            del module.torch


def prepare_4d_causal_attention_mask(
    attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None
):
    """Additive causal mask [batch, 1, query, key] (0 = attend, dtype min = masked), as transformers 4.x."""
    import torch

    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    bsz, q_len = input_shape[0], input_shape[-1]
    kv_len = q_len + past_key_values_length
    if attention_mask is not None and attention_mask.dim() == 4:
        expected = (bsz, 1, q_len, kv_len)
        if tuple(attention_mask.shape) != expected:
            raise ValueError(f"4-D attention_mask must be {expected}, got {tuple(attention_mask.shape)}")
        return attention_mask
    min_val = torch.finfo(dtype).min
    q = torch.arange(q_len, device=device)[:, None] + past_key_values_length
    k = torch.arange(kv_len, device=device)[None, :]
    allowed = k <= q
    if sliding_window is not None:
        allowed &= k >= q - sliding_window  # as transformers 4.x: the window plus the token itself
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device).masked_fill(~allowed, min_val)
    mask = mask[None, None].expand(bsz, 1, q_len, kv_len).clone()
    if attention_mask is not None:
        pad = attention_mask[:, None, None, :].to(device) == 0
        mask = mask.masked_fill(pad, min_val)
    return mask


class AttnMaskUtilsPatch(Patch):
    name = "transformers_attn_mask_utils"
    module = "transformers"
    targets = (f"{_SHIM} (module)",)
    package = "transformers"
    versions = ">=5.0.0.dev0"
    process = "both"
    risk = "low: only installed when transformers lacks the module"
    description = "speculators.models.eagle imports _prepare_4d_causal_attention_mask from a module newer 5.x removed"
    test = "tests/test_attn_mask_shim.py"

    def needed(self, module):
        present = sys.modules.get(_SHIM)
        if present is not None and not is_ours(present):
            return None
        if present is None and importlib.util.find_spec(_SHIM) is not None:
            return None
        return f"{_SHIM} is missing from this transformers"

    def _apply(self, module):
        shim = types.ModuleType(_SHIM, "speculators_compat shim for the removed transformers module")
        shim.__spec__ = importlib.machinery.ModuleSpec(_SHIM, None)  # so find_spec() works on it
        shim._prepare_4d_causal_attention_mask = prepare_4d_causal_attention_mask
        setattr(shim, SENTINEL, self.name)
        sys.modules[_SHIM] = shim
        module.modeling_attn_mask_utils = shim

    def _revert(self, module):
        shim = sys.modules.get(_SHIM)
        if is_ours(shim) == self.name:
            del sys.modules[_SHIM]
            if module is not None and getattr(module, "modeling_attn_mask_utils", None) is shim:
                delattr(module, "modeling_attn_mask_utils")

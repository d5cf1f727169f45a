"""The transformers_attn_mask_utils shim: equal to transformers' own function where it still exists,
and importable under the old name when it does not (simulated: the module removed from this
transformers, as in 5.24)."""

import importlib.util
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from speculators_compat.patches.transformers_compat import (  # noqa: E402
    _SHIM,
    AttnMaskUtilsPatch,
    prepare_4d_causal_attention_mask,
)


@pytest.mark.parametrize("past,window,pad", [(0, None, False), (3, None, True), (0, 4, False), (2, 3, True)])
def test_shim_equals_transformers(past, window, pad):
    mod = pytest.importorskip(_SHIM)
    if getattr(mod, "_self_speculators_compat", None):
        pytest.skip("this transformers has no modeling_attn_mask_utils (our shim stands in): nothing to compare")
    real = mod._prepare_4d_causal_attention_mask
    bsz, q = 2, 7
    emb = torch.zeros(bsz, q, 8)
    mask = None
    if pad:
        mask = torch.ones(bsz, q + past, dtype=torch.long)
        mask[1, :2] = 0
    kw = {"sliding_window": window} if window else {}
    want = real(mask, (bsz, q), emb, past, **kw)
    got = prepare_4d_causal_attention_mask(mask, (bsz, q), emb, past, **kw)
    assert torch.equal((want < 0), (got < 0))


def test_patch_installs_module_when_missing(monkeypatch):
    import transformers

    monkeypatch.delitem(sys.modules, _SHIM, raising=False)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == _SHIM else real_find(name, *a))
    p = AttnMaskUtilsPatch()
    monkeypatch.setattr(p, "version_applies", lambda: (True, "transformers 5.x"))
    p.on_import(transformers)
    try:
        assert p.is_applied(), p.state.reason
        from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask as f

        assert f is prepare_4d_causal_attention_mask
    finally:
        p.revert()
    assert getattr(sys.modules.get(_SHIM), "_self_speculators_compat", None) is None

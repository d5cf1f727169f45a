"""The Kimi-K2.5-layout test checkpoints (speculators_compat.testing.kimi): the INT4 experts must be
stored exactly as compressed-tensors stores them, or the GPU run would prove nothing."""

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from speculators_compat.testing import kimi  # noqa: E402


def _ct_pack():
    ct = pytest.importorskip("compressed_tensors")
    for mod in (
        "compressed_tensors.compressors.pack_quantized.helpers",
        "compressed_tensors.compressors.quantized_compressors.pack_quantized",
    ):
        try:
            m = __import__(mod, fromlist=["pack_to_int32"])
            return m.pack_to_int32, m.unpack_from_int32
        except ImportError:
            continue
    pytest.skip(f"compressed_tensors {ct.__version__}: pack_to_int32 not found")


def test_int4_packing_is_compressed_tensors_own():
    pack, unpack = _ct_pack()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g).to(torch.bfloat16)
    q, scale, deq = kimi.quantize_int4(w, 32)
    assert q.min() >= -8 and q.max() <= 7 and scale.shape == (96, 8) and scale.dtype == torch.bfloat16
    packed = kimi.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (96, 32)
    assert torch.equal(packed, pack(q, 4))
    assert torch.equal(unpack(packed, 4, torch.Size([96, 256])).to(torch.int8), q)
    assert torch.equal(kimi.unpack_int4(packed, 256), q)
    # what an engine dequantizes is exactly the reference weight (bf16 of q * scale)
    assert torch.equal(deq, (q.float() * scale.float().repeat_interleave(32, dim=1)).to(torch.bfloat16))
    assert float((deq.float() - w.float()).norm() / w.float().norm()) < 0.15  # 4 bits, group 32


def test_quantize_refuses_a_ragged_group():
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        kimi.quantize_int4(torch.ones(4, 48), 32)


def test_wrap_int4_layout(tmp_path):
    from safetensors.torch import load_file

    from speculators_compat.testing import models

    src = models.build("deepseek_v3")
    out, ref = kimi.wrap(src, tmp_path / "k25", int4_group=32, ref_dir=tmp_path / "deq"), tmp_path / "deq"
    text = load_file(str(next(src.glob("*.safetensors"))))
    got = load_file(str(out / "model.safetensors"))
    deq = load_file(str(ref / "model.safetensors"))
    experts = [n for n in text if kimi.EXPERT.match(n)]
    assert len(experts) == 3 * 8 * 3  # layers 1..3 are MoE (first_k_dense_replace=1), 8 experts, 3 projections
    for n in experts:
        stem = "language_model." + n.removesuffix(".weight")
        assert stem + ".weight" not in got
        shape = got[stem + ".weight_shape"].tolist()
        assert shape == list(text[n].shape)
        q = kimi.unpack_int4(got[stem + ".weight_packed"], shape[1])
        scale = got[stem + ".weight_scale"].float().repeat_interleave(32, dim=1)
        assert torch.equal((q.float() * scale).to(deq[n].dtype), deq[n])
    for n, t in text.items():
        if n not in experts:
            assert torch.equal(got["language_model." + n], t) and torch.equal(deq[n], t)
    assert any(k.startswith("vision_tower.") for k in got) and any(k.startswith("mm_projector.") for k in got)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    qc = cfg["text_config"]["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32

    def ignored(layer):  # compressed-tensors' rule: "re:" entries are regexes, the rest exact names
        return any(re.match(p[3:], layer) if p.startswith("re:") else p == layer for p in qc["ignore"])

    lm = "language_model.model.layers"
    assert ignored(f"{lm}.1.self_attn.kv_b_proj") and ignored(f"{lm}.2.mlp.shared_experts.down_proj")
    assert ignored(f"{lm}.0.mlp.gate_proj") and ignored("lm_head")
    assert not ignored(f"{lm}.1.mlp.experts.3.gate_proj") and not ignored(f"{lm}.1.mlp.experts")
    pre = json.loads((out / "preprocessor_config.json").read_text())
    module, cls = pre["auto_map"]["AutoImageProcessor"].split(".")
    assert f"class {cls}(" in (out / f"{module}.py").read_text()

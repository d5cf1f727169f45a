"""Decoder discovery for the model layouts vLLM uses (text models and VLM wrappers)."""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from speculators_compat.engine.capture import find_base_model  # noqa: E402


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])


class TextModel(nn.Module):  # Llama/Qwen2/DeepseekV3ForCausalLM: model.model.layers
    def __init__(self):
        super().__init__()
        self.model = Decoder()


class KimiK25_015(nn.Module):  # vLLM 0.15: language_model IS the decoder; get_language_model() returns it
    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Linear(2, 2)
        self.language_model = Decoder()

    def get_language_model(self):
        return self.language_model


class KimiK25_016(nn.Module):  # vLLM 0.16+: language_model is a DeepseekV2ForCausalLM (.model.layers)
    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Linear(2, 2)
        self.language_model = TextModel()

    def get_language_model(self):
        return self.language_model


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Decoder()


@pytest.mark.parametrize(
    "cls,path", [(TextModel, "model"), (KimiK25_015, "language_model"), (KimiK25_016, "language_model.model")]
)
def test_layouts(cls, path):
    m = cls()
    want = m
    for part in path.split("."):
        want = getattr(want, part)
    assert find_base_model(m) is want


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cannot find the decoder layers of Broken"):
        find_base_model(Broken())

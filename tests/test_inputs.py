"""Bad input gets a clear error that names the problem (no engine needed)."""
import pytest

from speculators_compat.generator import default_layer_ids, normalize_layer_ids, to_token_lists


@pytest.mark.parametrize("batch,exc,text", [
    ([], ValueError, "cannot be empty"),
    ([[1, 2], []], ValueError, "sequence 1 is empty"),
    ([[1, 2.5]], TypeError, "non-integer token 2.5"),
    ([[1, "a"]], TypeError, "non-integer token 'a'"),
    ([[1, True]], TypeError, "non-integer"),
    ([[1, -4]], ValueError, "negative token id -4"),
    ("hello", TypeError, "list of token-id lists"),
    ([5, 6], TypeError, "sequence 0 must be a list"),
])
def test_bad_batches(batch, exc, text):
    with pytest.raises(exc, match=text):
        to_token_lists(batch)


def test_tensor_batches():
    torch = pytest.importorskip("torch")
    assert to_token_lists(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="2-D"):
        to_token_lists(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="floating"):
        to_token_lists(torch.zeros(2, 3))
    # a ragged batch cannot even be a tensor; as nested lists it is fine
    assert to_token_lists([torch.tensor([1, 2, 3]), torch.tensor([4])]) == [[1, 2, 3], [4]]


@pytest.mark.parametrize("ids,exc,text", [
    ([], ValueError, "empty"),
    ([1, 1], ValueError, "duplicate layer ids \\[1\\]"),
    ([-1], ValueError, "out of bounds"),
    ([6], ValueError, "out of bounds \\[0, 5\\]"),
    ([1.0], TypeError, "integers"),
])
def test_bad_layer_ids(ids, exc, text):
    with pytest.raises(exc, match=text):
        normalize_layer_ids(ids, 6)


def test_layer_conventions():
    assert default_layer_ids(61) == [2, 30, 58, 60]  # Kimi-K2.5
    assert normalize_layer_ids([3, 31, 59, 61], 61, "eagle3") == [2, 30, 58, 60]
    with pytest.raises(ValueError, match="id 0, the embeddings"):
        normalize_layer_ids([0], 61, "eagle3")
    with pytest.raises(ValueError, match="layer_id_convention"):
        normalize_layer_ids([1], 6, "hf")

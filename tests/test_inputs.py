"""Bad input gets a clear error that names the problem (no engine needed)."""

import pytest

from speculators_compat.generator import default_layer_ids, normalize_layer_ids, to_token_lists


@pytest.mark.parametrize(
    "batch,exc,text",
    [
        ([], ValueError, "cannot be empty"),
        ([[1, 2], []], ValueError, "sequence 1 is empty"),
        ([[1, 2.5]], TypeError, "non-integer token 2.5"),
        ([[1, "a"]], TypeError, "non-integer token 'a'"),
        ([[1, True]], TypeError, "non-integer"),
        ([[1, -4]], ValueError, "negative token id -4"),
        ("hello", TypeError, "list of token-id lists"),
        ([5, 6], TypeError, "sequence 0 must be a list"),
    ],
)
def test_bad_batches(batch, exc, text):
    with pytest.raises(exc, match=text):
        to_token_lists(batch)


def test_token_ids_checked_against_the_vocabulary():
    from speculators_compat.engine.core import check_token_ids
    from speculators_compat.errors import TokenIdError

    assert to_token_lists([[0, 1023], [5]], vocab_size=1024) == [[0, 1023], [5]]
    with pytest.raises(
        TokenIdError,
        match=r"sequence 1 holds token id 1024, outside the model's "
        r"vocabulary of 1024 ids \[0, 1023\]",
    ) as e:
        to_token_lists([[0, 1023], [5, 1024, 2]], vocab_size=1024)
    assert (e.value.seq, e.value.token, e.value.vocab) == (1, 1024, 1024)
    assert e.value.message("sample 17").startswith("sample 17 holds token id 1024")
    assert isinstance(e.value, ValueError)
    with pytest.raises(TokenIdError, match="sequence 0 holds a negative token id -1"):
        to_token_lists([[3, -1]], vocab_size=1024)
    # the engine's own check (the patched upstream class's path): first bad sequence, either side
    check_token_ids([[0, 1023]], 1024)
    with pytest.raises(TokenIdError, match="sequence 2 holds token id 5000"):
        check_token_ids([[1], [2], [3, 5000]], 1024)
    with pytest.raises(TokenIdError, match="sequence 0 holds a negative token id -4"):
        check_token_ids([[-4, 5000]], 1024)
    check_token_ids([[1, 10**9]], None)  # vocabulary unknown: sign only


def test_tensor_batches():
    torch = pytest.importorskip("torch")
    assert to_token_lists(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="2-D"):
        to_token_lists(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="must hold integers, not torch.float32"):
        to_token_lists(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="not torch.bool"):
        to_token_lists(torch.ones(2, 3, dtype=torch.bool))
    # a ragged batch cannot even be a tensor; as nested lists it is fine
    assert to_token_lists([torch.tensor([1, 2, 3]), torch.tensor([4])]) == [[1, 2, 3], [4]]
    with pytest.raises(ValueError, match="sequence 1 must be 1-D, got a Tensor of shape \\(1, 2\\)"):
        to_token_lists([torch.tensor([1]), torch.tensor([[1, 2]])])


def test_numpy_batches():
    """A datasets column in numpy format: a 2-D array, or a list of 1-D arrays, or lists holding
    numpy integer scalars. Tokens come back as plain ints (vLLM's prompt validation wants ints)."""
    np = pytest.importorskip("numpy")
    out = to_token_lists(np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert out == [[1, 2], [3, 4]] and {type(t) for s in out for t in s} == {int}
    out = to_token_lists([np.array([5, 6, 7], dtype=np.uint16), [np.int64(8), 9]])
    assert out == [[5, 6, 7], [8, 9]] and {type(t) for s in out for t in s} == {int}
    with pytest.raises(TypeError, match="token_ids ndarray must hold integers, not float64"):
        to_token_lists(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="must be 2-D \\[batch, seq\\], got shape \\(3,\\)"):
        to_token_lists(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="sequence 0 holds a negative token id -2"):
        to_token_lists(np.array([[1, -2]]))
    with pytest.raises(TypeError, match="sequence 1 holds a non-integer token"):
        to_token_lists([[1], [np.float32(2.0)]])
    assert normalize_layer_ids(np.array([1, 3]), 6) == [1, 3]
    assert all(type(i) is int for i in normalize_layer_ids([np.int64(2)], 6))


@pytest.mark.parametrize(
    "ids,exc,text",
    [
        ([], ValueError, "empty"),
        ([1, 1], ValueError, "duplicate layer ids \\[1\\]"),
        ([-1], ValueError, "out of bounds"),
        ([7], ValueError, "out of bounds \\[0, 6\\] \\(6: the final state after the norm\\)"),
        ([1.0], TypeError, "integers"),
        (3, TypeError, "layer_ids must be a list of integers, not int"),
        ("2", TypeError, "layer_ids must be a list of integers, not str"),
    ],
)
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


def test_the_final_state_after_the_norm_is_one_past_the_last_layer():
    from speculators_compat.layers import final_layer_id

    assert final_layer_id(61) == 61 and final_layer_id(61, "eagle3") == 62
    assert normalize_layer_ids([3, 61, 62], 61, "eagle3") == [2, 60, 61]  # last layer (pre-norm), final (post-norm)
    assert normalize_layer_ids([60, 61], 61) == [60, 61]
    with pytest.raises(ValueError, match="62 is the final state after the norm"):
        normalize_layer_ids([63], 61, "eagle3")

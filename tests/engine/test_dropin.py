"""``speculators_compat.VllmHiddenStatesGenerator`` on the real engine, float32 (tolerance 1e-3).

Stress settings: max_num_batched_tokens=128 (every long prompt is split by chunked prefill over
many steps) and max_num_seqs=4 (batches of 13 and 40 span many steps, re-ordered by the runner).
"""

import pytest
from packaging.version import Version

from speculators_compat import VllmHiddenStatesGenerator
from speculators_compat.testing import models, reference
from tests.helpers import check_generate

TOL = reference.TOLERANCE["float32"]
LAYERS = [5, 0, 3, 6]  # deliberately unsorted: results follow this order; 6: the final state after the norm


@pytest.fixture(scope="module")
def gen(llama_path):
    # async "keep": leave vLLM's choice (the CPU platform forces it off); "disable" is the default
    # and covered by every other engine test.
    g = VllmHiddenStatesGenerator(
        llama_path,
        layer_ids=LAYERS,
        max_model_len=2048,
        dtype="float32",
        max_num_batched_tokens=128,
        max_num_seqs=4,
        async_scheduling="keep",
        self_check=True,  # (opt-in in the drop-in): every call of this module is checked
    )
    yield g
    g.close()


def check(gen, path, prompts, hf_ref, layers=LAYERS):
    return check_generate(gen, path, prompts, hf_ref, layers, TOL)


@pytest.mark.parametrize("n", [1, 13, 40])
def test_chunked_and_reordered(gen, llama_path, hf_ref, n):
    lengths = ([700, 5, 130, 37, 1500, 17, 64, 8, 256, 50, 99, 10, 11] * 4)[:n]
    check(gen, llama_path, models.random_prompts(lengths, seed=100 + n), hf_ref)


def test_one_token_prompts_and_one_token_chunks(gen, llama_path, hf_ref):
    """A step that schedules one token of a request looks like a decode to the runner, which moves
    such requests to the front of its batch (split of decodes and prefills): 1-token prompts, and
    prompts whose last chunk is 1 token (129 = 128 + 1 and 257 = 2 x 128 + 1 with this engine's
    128-token steps), mixed with long ones, in a batch spanning many steps."""
    lengths = [1, 300, 1, 2, 129, 1, 257, 3, 1, 50, 1, 128, 1, 129]
    check(gen, llama_path, models.random_prompts(lengths, seed=77), hf_ref)
    check(gen, llama_path, models.random_prompts([1], seed=78), hf_ref)  # a batch of one token


def test_repeat_call_same_results(gen, llama_path, hf_ref):
    prompts = models.random_prompts([300, 12, 129], seed=9)
    a = check(gen, llama_path, prompts, hf_ref)
    b = check(gen, llama_path, prompts, hf_ref)
    for ra, rb in zip(a, b):
        for x, y in zip(ra["hidden_states"], rb["hidden_states"]):
            assert (x - y).abs().max().item() <= 1e-5


def test_results_survive_later_calls_and_own_their_storage(gen, llama_path, hf_ref, tmp_path):
    """Results already returned (lent rows of the arena, or copies of rows split over steps) must
    not change when a later call with other prompts runs; each tensor's storage must be exactly
    its own rows (so torch.save of one sample writes that sample, nothing more)."""
    import torch

    first_prompts = models.random_prompts([600, 40, 333, 7], seed=21)
    first = check(gen, llama_path, first_prompts, hf_ref)
    # smaller than the first batch, so it is written over the same arena bytes
    check(gen, llama_path, models.random_prompts([500, 30, 200], seed=22), hf_ref)
    worst, bad = reference.compare([r["hidden_states"] for r in first], first_prompts, hf_ref(llama_path, LAYERS), TOL)
    assert not bad, f"earlier results changed after a later call (worst {worst})"
    for r in first:
        for h in r["hidden_states"]:
            assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    torch.save(first[1], tmp_path / "s.pt")
    payload = sum(h.numel() * h.element_size() for h in first[1]["hidden_states"])
    assert (tmp_path / "s.pt").stat().st_size < payload + 64 * 1024


def test_threaded_copy_out_matches_hf(gen, llama_path, hf_ref):
    """Copying out on several threads (what a GPU host does: 8 there, 1 on a CPU host): the
    results must still be each prompt's own rows, in input order (13 prompts, reordered and
    chunked). Copies happen with zero-copy off (on, every prompt comes back as one lent block).
    The reader's threads and lending are internal: set here on the running engine."""
    gen.engine._reader.set_threads(3)
    gen.engine._reader.lend = False
    try:
        res = check(
            gen,
            llama_path,
            models.random_prompts([700, 5, 130, 37, 1500, 17, 64, 8, 256, 50, 99, 10, 11], seed=77),
            hf_ref,
        )
        assert gen.engine._reader._pool is not None
        for r in res:
            for h in r["hidden_states"]:
                assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    finally:
        gen.engine._reader.set_threads(1)
        gen.engine._reader.lend = True


def test_prompts_split_over_steps_come_back_as_one_lent_block(gen, llama_path, hf_ref):
    """Each announced request gets one region of the arena per layer, and every step writes its
    rows at their positions there, so a prompt the scheduler splits over several steps (here up
    to 16: 128 tokens and 4 requests a step, reordered by the runner) is still one block: lent
    to the caller, not copied. Before, such a
    prompt came back in one block per step, which the driver copied into a tensor of its own
    (on the H200, 48 of 512 prompts of 1,000 tokens: generate() fell to 0.881 of raw vLLM)."""
    prompts = models.random_prompts([700, 5, 130, 2000, 37, 900, 17, 1100, 64, 8, 513, 511, 99], seed=31)
    reader = gen.engine._reader
    steps = gen.engine.stats()["steps"]
    res = check(gen, llama_path, prompts, hf_ref)  # HF-exact, in input order
    described = [[reader.describe(h) for h in r["hidden_states"]] for r in res]
    assert all(d is not None for layers in described for d in layers), [
        i for i, layers in enumerate(described) if None in layers
    ]
    assert gen.engine.stats()["steps"] - steps >= 40  # (5,300+ tokens at 128 a step)


def test_copy_hand_off_matches_hf(gen, llama_path, hf_ref):
    """zero_copy=False (or SPECULATORS_COMPAT_ZERO_COPY=0): every row is copied out; nothing is
    lent. Switched on the running engine (an engine of its own would cost a start)."""
    gen.engine._reader.lend = False
    try:
        res = check(
            gen, llama_path, models.random_prompts([20, 31, 9, 700, 25, 17, 30, 12, 28, 5, 22], seed=88), hf_ref
        )
        assert gen.engine._reader.busy() == []
        del res
    finally:
        gen.engine._reader.lend = True


def test_layer_convention_against_hf(gen, llama_path):
    """Upstream id L = output of decoder layer L before the final norm; the last layer (5) is NOT
    HF's last hidden_states entry (that one is after the norm)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = models.random_prompts([40], seed=4)[0]
    got = gen.generate([p])[0]["hidden_states"]
    m = AutoModelForCausalLM.from_pretrained(llama_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hs = m(torch.tensor([p]), output_hidden_states=True).hidden_states
    n = m.config.num_hidden_layers

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert rel(got[1], hs[0 + 1][0]) < TOL  # layer 0 == HF hidden_states[1]
    assert rel(got[2], hs[3 + 1][0]) < TOL  # layer 3 == HF hidden_states[4]
    assert rel(got[0], hs[n][0]) > 0.05  # layer n-1: HF's last entry is post-norm, so it differs
    assert rel(got[3], hs[n][0]) < TOL  # id n: the final state after the norm, HF's last entry


def test_eagle3_convention_maps_to_upstream(llama_path):
    from speculators_compat.generator import normalize_layer_ids, read_num_layers

    n = read_num_layers(llama_path)
    assert normalize_layer_ids([1, 4, 6], n, "eagle3") == [0, 3, 5]


def test_bad_inputs_leave_the_engine_usable(gen, llama_path, hf_ref):
    with pytest.raises(ValueError, match="cannot be empty"):
        gen.generate([])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        gen.generate([[5, 6], []])
    with pytest.raises(TypeError, match="non-integer"):
        gen.generate([[5, 6.0]])
    strict = gen.on_overlength
    gen.on_overlength = "error"
    try:
        with pytest.raises(ValueError, match="longer than max_model_len - 1 = 2047"):
            gen.generate(models.random_prompts([2048], seed=1))
    finally:
        gen.on_overlength = strict
    with pytest.raises(ValueError, match="at most max_model_len - 1"):
        gen.engine.run(models.random_prompts([2048], seed=1))  # the engine's own guard
    # ids the embedding table lacks (a batch tokenized for another model): named, never sent
    assert gen.engine.vocab_size == models.VOCAB
    with pytest.raises(
        ValueError,
        match=f"sequence 2 holds token id {models.VOCAB}, outside the model's "
        f"vocabulary of {models.VOCAB} ids \\[0, {models.VOCAB - 1}\\]",
    ):
        gen.generate([[5, 6], [models.VOCAB - 1], [7, models.VOCAB, 8]])
    with pytest.raises(ValueError, match="sequence 0 holds token id 50000"):
        gen.engine.run([[5, 50000]])  # the engine's own guard (the patched upstream class's path)
    with pytest.raises(ValueError, match="sequence 0 holds a negative token id -2"):
        gen.engine.run([[5, -2]])
    check(gen, llama_path, models.random_prompts([33], seed=2), hf_ref)


def test_announcing_ahead_gives_the_same_states_and_surfaces_its_failure(
    gen, llama_path, hf_ref, vllm_version, monkeypatch
):
    """Announcing ahead (the default from vLLM 0.12) sends each batch's announcement without
    waiting for the reply. The states must match HF and be bit-identical to waiting (13 prompts,
    chunked and reordered), and a worker that fails to take the announcement must fail that call
    with the worker's own error (not a later 'not captured'), leaving the engine usable. vLLM 0.11
    has no ordered replies: there it waits (the path compared with here, set on the engine)."""
    eng = gen.engine
    if vllm_version < Version("0.12"):
        assert not eng._announce_ahead
        return
    assert eng._announce_ahead
    prompts = models.random_prompts([700, 5, 130, 37, 1500, 17, 64, 8, 256, 50, 99, 10, 11], seed=77)
    eng._announce_ahead = False
    try:
        waited = [[h.clone() for h in r["hidden_states"]] for r in check(gen, llama_path, prompts, hf_ref)]
    finally:
        eng._announce_ahead = True
    try:
        ahead = check(gen, llama_path, prompts, hf_ref)
        assert all(torch_equal(a, b) for r, w in zip(ahead, waited) for a, b in zip(r["hidden_states"], w))
        del ahead
        # a real failure inside the worker's announcement: a busy list it cannot use
        monkeypatch.setattr(eng._reader, "busy", lambda slabs=None: [["not", "hashable"]])
        with pytest.raises(RuntimeError, match="unhashable"):
            gen.generate(prompts[:3])
        monkeypatch.undo()
        check(gen, llama_path, prompts, hf_ref)
    finally:
        eng._announce_ahead = True


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize("fault", ["swap", "zero", "shift"])
def test_the_self_check_reads_the_rows_handed_out(gen, llama_path, hf_ref, fault):
    """The final layer (5) is captured here, so the self-check reads its arena rows: the ones the
    caller gets. A fault made in the worker's capture (test_self_check.py) fails the batch."""
    from speculators_compat.errors import CaptureError

    prompts = models.random_prompts([16] * 12 if fault == "swap" else [5, 300, 37, 120, 9, 64, 8], seed=12)
    gen.engine.executor.collective_rpc("compat_inject_fault", args=(fault,))
    try:
        with pytest.raises(CaptureError, match=r"self-check: \d+ of \d+ prompts"):
            gen.generate(prompts)
    finally:
        gen.engine.executor.collective_rpc("compat_inject_fault", args=(None,))
    before = gen.engine.self_check_stats.as_dict()
    check(gen, llama_path, prompts, hf_ref)
    assert gen.engine.self_check_stats.since(before)["checked"] == len(prompts)

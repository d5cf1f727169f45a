"""The continuous engine loop (engine/stream.py) under ``serve``, in process: prompts submitted one
by one while others are in flight come back HF-right each (float32: 1e-3), the hand-off arena stays
at what is in flight under a stream that never drains, and a capture that fails its checks fails
only its own request; the others are right.
"""

from __future__ import annotations

import threading
import time

import pytest

from speculators_compat.testing import models, reference

pytestmark = pytest.mark.ends  # (the library's own loop over the engine: newest cell)

LAYERS = [0, 2]
STREAM = models.random_prompts([5, 300, 37, 120, 9, 64, 8, 50, 99, 10, 11, 200, 3, 70, 44, 17] * 3, seed=14)
EQUAL = models.random_prompts([24] * 12, seed=5)  # (the swap fault exchanges two such requests' rows)


@pytest.fixture(scope="module")
def loop(llama_path):
    from speculators_compat.engine.stream import StreamingLoop
    from speculators_compat.generator import VllmHiddenStatesGenerator

    gen = VllmHiddenStatesGenerator(
        llama_path,
        layer_ids=LAYERS,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=128,
        max_num_seqs=4,
        self_check=True,
    )
    lp = StreamingLoop(gen.engine)
    yield lp
    lp.close()
    gen.close()


def submit_staggered(lp, prompts, gap_s=0.005):
    """Submit from another thread, one by one, while the loop runs the earlier ones."""
    futs = [None] * len(prompts)

    def feed():
        for i, p in enumerate(prompts):
            futs[i] = lp.submit(p)
            time.sleep(gap_s)

    t = threading.Thread(target=feed)
    t.start()
    t.join()
    return futs


def test_a_stream_of_prompts_is_right_and_the_arena_stays_small(loop, llama_path, hf_ref):
    futs = submit_staggered(loop, STREAM)
    got = [f.result(timeout=600) for f in futs]
    worst, bad = reference.compare([g.states for g in got], STREAM, hf_ref(llama_path, LAYERS), 1e-3)
    assert not bad, (worst, bad[:3])
    st = loop.engine.stats()  # (the loop is idle: no RPC of its own in flight)
    biggest = max(map(len, STREAM)) * len(LAYERS) * 128 * 4  # one prompt's rows, float32
    print(f"arena after the stream: {st['arena_slabs']} slabs, {st['arena_bytes']:,} bytes")
    assert st["arena_slabs"] <= 4 and st["arena_bytes"] < 40 * biggest, st
    assert loop.served >= len(STREAM) and loop.in_flight == 0


def test_a_failed_capture_fails_only_its_own_request(loop, llama_path, hf_ref):
    from speculators_compat.errors import CaptureError

    rpc = loop.engine.executor.collective_rpc
    rpc("compat_inject_fault", args=("swap",))
    try:
        futs = [loop.submit(p) for p in EQUAL]
        outcomes = [f.exception(timeout=600) or f.result() for f in futs]
    finally:
        rpc("compat_inject_fault", args=(None,))
    failed = [i for i, o in enumerate(outcomes) if isinstance(o, CaptureError)]
    assert failed and len(failed) < len(EQUAL), outcomes
    assert all("self-check" in str(outcomes[i]) for i in failed)
    ok = [i for i in range(len(EQUAL)) if i not in failed]
    ref = hf_ref(llama_path, LAYERS)
    worst, bad = reference.compare([outcomes[i].states for i in ok], [EQUAL[i] for i in ok], ref, 1e-3)
    assert not bad, (worst, bad[:3])  # what was delivered is right
    again = [f.result(timeout=600) for f in [loop.submit(p) for p in EQUAL]]
    worst, bad = reference.compare([g.states for g in again], EQUAL, ref, 1e-3)
    assert not bad, (worst, bad[:3])

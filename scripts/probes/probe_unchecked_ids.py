"""What vLLM does with a token id the model's embedding table lacks, when nothing checks it.

The engine loop hands vLLM token ids directly (past the input processor that checks them for
``LLM.generate``), so ``ExtractionEngine`` checks them itself (``TokenIdError``). This probe turns
that check off (``run(..., ids_checked=True)``) and feeds ids at and beyond ``vocab_size`` and a
negative one, on the tiny Llama, to record the failure the check prevents:

    python scripts/probes/probe_unchecked_ids.py TP [float32|bfloat16]

It prints, per bad id, the error (or, where there is none, the captured row's norm next to a
neighbour's) and whether the engine still answers a good prompt afterwards.
"""

import sys
import time

from speculators_compat import VllmHiddenStatesGenerator
from speculators_compat.testing import models


def main() -> int:
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    path = str(models.build("llama"))
    gen = VllmHiddenStatesGenerator(
        path, layer_ids=[0, 5], dtype=dtype, tensor_parallel_size=tp, gpu_memory_utilization=0.3
    )
    print(f"tp={tp} dtype={dtype} vocab_size={gen.engine.vocab_size}", flush=True)
    good = models.random_prompts([10], seed=1)[0]
    for bad in (models.VOCAB, models.VOCAB + 100, -1):
        prompt = good[:5] + [bad] + good[5:]
        t0 = time.time()
        try:
            rows = gen.engine.run([prompt], ids_checked=True)[0][0]
            print(
                f"id {bad}: no error ({time.time() - t0:.1f} s); layer-0 row 5 norm "
                f"{float(rows[5].float().norm()):.4f}, row 4 {float(rows[4].float().norm()):.4f}",
                flush=True,
            )
        except BaseException as e:  # noqa: BLE001 - the probe reports whatever vLLM raised
            print(f"id {bad}: {type(e).__name__}: {str(e)[:300]} ({time.time() - t0:.1f} s)", flush=True)
        try:
            gen.engine.run([good])
            print("  the engine still answers a good prompt", flush=True)
        except BaseException as e:  # noqa: BLE001
            print(f"  the engine is gone: {type(e).__name__}: {str(e)[:200]}", flush=True)
            break
    gen.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

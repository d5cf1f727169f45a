"""What ``throughput.py`` prints and writes once its timed rounds are over: the table of medians,
the ratios (each pipeline row also against what bounds it), the pipeline's and the engine's split
of their time, the FP8 error of the first batch, and the same figures as JSON (``--json``)."""

from __future__ import annotations

import json
import os
import statistics


def report(b, fp8_error: dict | None) -> None:
    """Print every figure ``b`` (a throughput.Bench whose rounds are done) recorded; write them to
    ``--json`` too."""
    rows = _rows(b)
    env = _env(b)
    first_batch = _first_batch(b)
    print(json.dumps(env))
    print("| contender | tokens/s (median) | spread (min-max) | runs |")
    print("|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['tok_s_median']:,.0f} | {r['tok_s_min']:,.0f} - {r['tok_s_max']:,.0f} | {r['runs']} |")
    ratios = _ratios(b, rows)
    plain_bps = _bounds(b, ratios, rows)
    _batches_only(b, ratios, rows)
    gen_key = next(k for k in rows if k.startswith("generate"))
    if "native" in rows:
        ratios["native/raw"] = rows["native"]["tok_s_median"] / rows["raw"]["tok_s_median"]
        ratios[f"{gen_key}/native"] = rows[gen_key]["tok_s_median"] / rows["native"]["tok_s_median"]
    if "hf" in rows:
        ratios[f"{gen_key}/hf"] = rows[gen_key]["tok_s_median"] / rows["hf"]["tok_s_median"]
    if b.a.json:
        figures = {
            "env": env,
            "rows": rows,
            "ratios": ratios,
            "raw_times_s": b.times,
            "pipeline_breakdown_s": b.breakdown,
            "arena_slabs_made": b.slabs_made,
            "engine_s": b.engine_s,
            "driver_gc": b.gc_s,
            "batch_times_s": b.batch_s,
            "first_batch": first_batch,
            "native": b.native_info or None,
            "fp8_error": fp8_error,
            "plain_write_bytes_per_s": plain_bps,
        }
        with open(b.a.json, "w") as f:
            json.dump(figures, f, indent=1)
    _print_splits(b, first_batch)
    if fp8_error:
        print("fp8 error, first batch, per layer and token (relative L2 over hidden):", json.dumps(fp8_error))
    print("ratios: " + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items()))


def _rows(b) -> dict:
    return {
        k: {
            "tok_s_median": b.tokens / statistics.median(v),
            "tok_s_min": b.tokens / max(v),
            "tok_s_max": b.tokens / min(v),
            "runs": len(v),
        }
        for k, v in b.times.items()
    }


def _env(b) -> dict:
    from speculators_compat import versions

    a, torch = b.a, b.torch
    return {
        "device": torch.cuda.get_device_name(0) if b.cuda else f"cpu x{os.cpu_count()}",
        "vllm": versions.installed("vllm"),
        "torch": torch.__version__,
        "model": a.model,
        "batch": a.batch,
        "batches": a.batches,
        "seq": a.seq_mixed or a.seq,
        "tokens": b.tokens,
        "dtype": a.dtype,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "out_dir": b.default_dir,
        "out_dirs": b.out_dirs if a.out_dirs else None,
        "file_cost_us": b.file_cost,
        "sample_bytes": b.sample_bytes,
        "layer_ids": b.layer_ids_resolved,
    }


def _first_batch(b) -> dict:
    """Per timed run: the first batch's tokens/s over the median of the run's other batches."""
    per_batch_tokens = [sum(len(p) for p in batch) for batch in b.batches]
    if len(b.batches) < 2:
        return {}
    out = {}
    for k, runs in b.batch_s.items():
        out[k] = [
            round(
                (per_batch_tokens[0] / ts[0])
                / statistics.median(n / t for n, t in zip(per_batch_tokens[1:], ts[1:], strict=True)),
                3,
            )
            for ts in runs
        ]
    return out


def _generate_rows(rows) -> dict:
    """Engine variant tag (what follows ``generate[DEVICE]``, e.g. ``[fp8]``) -> its generate() row."""
    return {k[k.index("]") + 1 :]: k for k in rows if k.startswith("generate")}


def _ratios(b, rows) -> dict:
    """Each generate() row over raw vLLM, and each pipeline row over its engine's generate()."""
    ratios = {}
    for tag, gen_key in _generate_rows(rows).items():
        ratios[f"{gen_key}/raw"] = rows[gen_key]["tok_s_median"] / rows["raw"]["tok_s_median"]
        for pk in [k for k in rows if b.pipeline_tag.get(k) == tag]:
            ratios[f"{pk}/{gen_key}"] = rows[pk]["tok_s_median"] / rows[gen_key]["tok_s_median"]
    return ratios


def _bounds(b, ratios, rows) -> dict:
    """Into ``ratios``: each pipeline row over what bounds it, min(its engine's generate(), the plain
    write's bytes/s to its directory over the row's bytes per token); each FP8 pipeline row over the
    same row unquantized; each FP8 generate() over the unquantized one. Returns the plain write's
    bytes/s per directory (median run)."""
    plain_bytes = sum(b.plain_sizes)
    plain_bps = {k[6:-1]: plain_bytes / statistics.median(v) for k, v in b.times.items() if k.startswith("plain[")}
    for d, bps in plain_bps.items():
        print(f"plain write to {d}: {bps / 1e9:.2f} GB/s")
    gens = _generate_rows(rows)
    for pk, d in b.pipeline_dir.items():
        gk = gens.get(b.pipeline_tag[pk])
        if pk not in rows or gk is None:
            continue
        bound = rows[gk]["tok_s_median"]
        if d in plain_bps:
            bound = min(bound, plain_bps[d] / b.breakdown[pk][0]["bytes_per_token"])
        ratios[f"{pk}/min({gk},plain[{d}])"] = rows[pk]["tok_s_median"] / bound
        bf16 = pk.replace("[fp8]", "", 1)
        if bf16 != pk and bf16 in rows:
            ratios[f"{pk}/{bf16}"] = rows[pk]["tok_s_median"] / rows[bf16]["tok_s_median"]
    for tag, gk in gens.items():
        bf16 = gens.get(tag.replace("[fp8]", "", 1))
        if "[fp8]" in tag and bf16:
            ratios[f"{gk}/{bf16}"] = rows[gk]["tok_s_median"] / rows[bf16]["tok_s_median"]
    return plain_bps


def _batches_only(b, ratios, rows) -> None:
    """Into ``ratios``: each pipeline row's median run less its fixed cost (``prepare_s`` before the
    engine, ``finish_s`` after the last file: a run's, whatever its length) over its engine's
    generate(), as ``PIPELINE[batches]/GENERATE``: what a run long enough to amortize them keeps."""
    gens = _generate_rows(rows)
    for pk, runs in b.breakdown.items():
        gk = gens.get(b.pipeline_tag.get(pk))
        if gk is None:
            continue
        s = statistics.median(r["total_s"] - r["prepare_s"] - r["finish_s"] for r in runs)
        ratios[f"{pk}[batches]/{gk}"] = b.tokens / s / rows[gk]["tok_s_median"]


def _print_splits(b, first_batch) -> None:
    """Medians of where each pipeline run and each engine call's time went; slabs, GC, native."""
    for k, v in b.breakdown.items():
        med = {f: statistics.median(r[f] for r in v) for f in v[0] if f.endswith("_s")}
        print(f"{k}: median s per run: " + ", ".join(f"{f} {x:.3f}" for f, x in med.items()))
    print("arena slabs made per timed run:", json.dumps(b.slabs_made))
    for k, v in b.engine_s.items():  # (the keys: throughput.ENGINE_KEYS)
        if v and v[0]:
            print(
                f"{k}: engine median s per run: "
                + ", ".join(f"{f} {statistics.median(r[f] for r in v):.3f}" for f in v[0])
            )
    for k, v in b.gc_s.items():
        print(
            f"{k}: driver GC per run: median {statistics.median(r['gc_s'] for r in v):.4f} s, "
            f"full collections {[r['full_collections'] for r in v]}"
        )
    if first_batch:
        print("first batch tokens/s over the run's other batches, per timed run:", json.dumps(first_batch))
    info = b.native_info
    if info:
        print("native:", json.dumps({k: v for k, v in info.items() if k != "complete_at_return"}))
        done = info.get("complete_at_return") or []
        if done:
            print(f"native: files complete when generate() returned: {statistics.mean(done):.1%} on average")
    for k, v in b.breakdown.items():
        print(f"{k}: bytes per token {v[0]['bytes_per_token']:,.1f}")


def fp8_error(b) -> dict | None:
    """Worst and median relative error per (layer, token) of the FP8 states, against the
    unquantized engine's and against HF's (float32); and the unquantized states' against HF."""
    first = b.first_states
    if "fp8" not in first or "auto" not in first:
        return None
    import torch

    from speculators_compat.testing.reference import HFReference

    # float32 on the GPU when there is one (the engines are shut by now); the CPU takes minutes
    ref = HFReference(b.path, b.layer_ids_resolved, device="cuda" if torch.cuda.is_available() else "cpu")

    def rel(x, y):  # [T, L, H] -> [T * L]
        return ((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).flatten()

    hf = [torch.stack(ref(p), dim=1) for p in b.batches[0]]
    out = {}
    for name, pairs in (
        ("fp8_vs_unquantized", zip(first["fp8"], first["auto"])),
        ("fp8_vs_hf", zip(first["fp8"], hf)),
        ("unquantized_vs_hf", zip(first["auto"], hf)),
    ):
        e = torch.cat([rel(x, y) for x, y in pairs])
        out[name] = {"worst": round(float(e.max()), 5), "median": round(float(e.median()), 5)}
    return out

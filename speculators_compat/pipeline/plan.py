"""``speculators-compat plan`` / ``extract --dry-run``: sizes from config.json alone (no weights, no vLLM).

Counts parameters per architecture family (Llama/Qwen2-style dense; DeepSeek-V3/Kimi-K2 MLA+MoE,
also inside a VLM's ``text_config``; a ViT tower from ``vision_config``), applies the checkpoint's
``quantization_config`` (compressed-tensors int-N with group scales on the layers it targets), then:
  * weights per GPU under tensor parallelism (vocab/heads/experts sharded; MLA latent projections,
    norms and routers replicated);
  * KV cache bytes per token per GPU (MLA: the 512+64 latent is replicated on every TP rank;
    GQA: KV heads are sharded when there are at least TP of them);
  * capture buffers: max_num_batched_tokens x captured layers x hidden on the GPU per step;
  * the host's hand-off arena (/dev/shm, page-locked on a GPU): the extract pipeline holds up to
    queue_size + 2 batches of states there, each slab sized with the worker's headroom;
  * hidden-state bytes per token and, with a dataset, for the whole output (+ ids and loss masks).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..engine.config import STATES_DTYPES
from .model_sizes import (
    Quant,
    count_params,
    group_layers,
    kv_bytes_per_token,
    quantization_of,
    text_config,
    weight_bytes,
)

GiB = 1024**3
GB = 1000**3


@dataclass
class Plan:
    model: str
    architecture: str
    num_layers: int
    hidden_size: int
    layer_ids: list[int]
    tensor_parallel_size: int
    params_total: int
    params_quantized: int
    weight_bytes_total: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    tokens_per_step: int
    capture_bytes_per_step: int
    hidden_bytes_per_token: int
    disk_bytes_per_token: int  # hidden states + int64 input_ids and loss_mask: what the disk absorbs
    gpu_memory_bytes: int
    kv_cache_bytes_per_gpu: int
    kv_cache_tokens: int
    notes: list[str] = field(default_factory=list)
    dataset: dict[str, Any] | None = None
    batch_size: int | None = None
    # /dev/shm the extract pipeline's hand-off arena may take (TP rank 0's host), from the largest
    # batch: the dataset's when read, else batch_size prompts at max_model_len - 1 tokens
    handoff_batch_tokens: int | None = None
    handoff_bytes: int | None = None
    # the run split into this many parts (--world-size x --data-parallel-size): each part's share
    parts: int = 1
    states_dtype: str = "auto"
    by_states_dtype: dict = field(default_factory=dict)  # per --states-dtype: bytes per token, disk
    pipeline_parallel_size: int = 1
    # per pipeline stage: its layers, the captured ones, weights / KV / capture bytes per GPU
    stages: list = field(default_factory=list)


def state_bytes_per_token(layers: int, hidden: int, dtype_bytes: int, states_dtype: str = "auto") -> int:
    """A token's hidden states: ``dtype_bytes`` per value, or (``fp8``) one byte per value plus its
    float32 scale (engine/fp8.py)."""
    return layers * hidden + 4 if states_dtype == "fp8" else layers * hidden * dtype_bytes


def disk_bytes_per_token(layers: int, hidden: int, dtype_bytes: int, states_dtype: str = "auto") -> int:
    """What a token costs on the output disk: its hidden states, plus int64 input_ids and loss_mask."""
    return state_bytes_per_token(layers, hidden, dtype_bytes, states_dtype) + 8 + 8


def stage_figures(
    info: dict, t: dict, ids: list, tp: int, pp: int, dtype_bytes: int, qz: Quant, mnbt: int
) -> list[dict]:
    """Per pipeline stage (layers as vLLM splits them: layers.stage_ranges): the captured layers it
    computes, its weights per GPU (its layers' share of each group; embeddings on the first stage,
    lm_head on the last), its KV-cache bytes per token per GPU and its capture buffer per step.
    Empty without pipeline parallelism."""
    from ..layers import stage_ranges

    if pp < 2:
        return []
    n = info["layers"]
    dense = t.get("first_k_dense_replace", 0) if (t.get("n_routed_experts") or t.get("num_experts")) else 0
    kv_all = kv_bytes_per_token(t, info, tp, dtype_bytes)
    out = []
    for s, (a, b) in enumerate(stage_ranges(n, pp)):
        wbytes = 0.0
        for name, count, sharded, routed in info["groups"]:
            where = group_layers(name, n, dense)
            if isinstance(where, str):
                share = 1.0 if (where == "first" and s == 0) or (where == "last" and s == pp - 1) else 0.0
            else:
                lo, hi = where
                share = max(0, min(b, hi) - max(a, lo)) / max(1, hi - lo)
            per = share * qz.bytes_of(name, count, routed, dtype_bytes)
            wbytes += per / tp if sharded else per
        own = [i for i in ids if a <= i < b or (i == n and b == n)]  # (id n: the final norm's, last stage)
        out.append(
            {
                "stage": s,
                "layers": [a, b],
                "captures": own,
                "weight_bytes_per_gpu": int(wbytes),
                "kv_bytes_per_token_per_gpu": int(kv_all * (b - a) / n),
                "capture_bytes_per_step": mnbt * len(own) * info["hidden"] * dtype_bytes,
            }
        )
    return out


def _fit_stages(stages: list, room: float) -> tuple[int, int, int, int]:
    """Each stage's KV cache per GPU from ``room`` (usable memory less activations); then the
    figures of the stage with the fewest KV tokens, which bounds the engine: (weight bytes per GPU,
    KV bytes per token per GPU, KV cache bytes per GPU), and the largest capture buffer."""
    for st in stages:
        left = int(room - st["weight_bytes_per_gpu"] - st["capture_bytes_per_step"])
        st["kv_cache_bytes_per_gpu"] = max(left, 0)
        st["kv_cache_tokens"] = max(left, 0) // max(st["kv_bytes_per_token_per_gpu"], 1)
    b = min(stages, key=lambda st: st["kv_cache_tokens"])
    capture = max(st["capture_bytes_per_step"] for st in stages)
    return b["weight_bytes_per_gpu"], b["kv_bytes_per_token_per_gpu"], b["kv_cache_bytes_per_gpu"], capture


def _notes(qdesc: str, mnbt: int, activation: int, info: dict, dtype_bytes: int, kv_budget: int) -> list[str]:
    notes = [
        f"quantization: {qdesc}",
        f"tokens per step: {mnbt} (max_num_batched_tokens; chunked prefill splits longer prompts)",
        f"activation peak per step (estimate): {activation / GiB:.1f} GiB per GPU",
    ]
    vit = sum(count for name, count, _, _ in info["groups"] if name.startswith("vision tower"))
    if vit:
        notes.append(
            f"vision tower: {vit * dtype_bytes / GiB:.2f} GiB, counted on every GPU; extraction is text "
            "only and vLLM 0.17+ does not load it (language_model_only), so that much is spare there"
        )
    if kv_budget <= 0:
        notes.append("WEIGHTS DO NOT FIT: raise tensor parallelism or use a quantized checkpoint")
    return notes


def _dataset_sizes(samples: int | None, tokens: int | None, hidden_per_token: int, per_token_disk: int) -> dict | None:
    if not tokens:
        return None
    return {
        "samples": samples,
        "tokens": tokens,
        "hidden_state_bytes": tokens * hidden_per_token,
        "disk_bytes": tokens * per_token_disk + (samples or 0) * 1500,
    }


def _by_states_dtype(layers: int, h: int, dtype_bytes: int, samples: int | None, tokens: int | None) -> dict:
    """Each states dtype's bytes per token (and disk, with a dataset), whichever was chosen."""
    both = {}
    for sd in STATES_DTYPES:
        per_token = state_bytes_per_token(layers, h, dtype_bytes, sd)
        disk = disk_bytes_per_token(layers, h, dtype_bytes, sd)
        both[sd] = {"hidden_bytes_per_token": per_token, "disk_bytes_per_token": disk}
        if sizes := _dataset_sizes(samples, tokens, per_token, disk):
            both[sd]["disk_bytes"] = sizes["disk_bytes"]
    return both


def _handoff(batch_size, max_batch_tokens, max_model_len, queue_size, hidden_per_token) -> tuple:
    """(largest batch's tokens, host hand-off bytes) of a pipeline run, or (None, None)."""
    if not batch_size:
        return None, None
    from ..engine import ARENA_HEADROOM

    tokens = max_batch_tokens or batch_size * (max_model_len - 1)
    # the slabs the pipeline asks for (its queue plus the batch computed), each with headroom
    return tokens, int((max(1, queue_size) + 2) * ARENA_HEADROOM * tokens * hidden_per_token)


def _read_config(model: str) -> dict:
    cfg_path = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{model}: config.json not found (the plan reads only the model's config.json)")
    return json.loads(cfg_path.read_text())


def make_plan(
    model: str,
    *,
    layer_ids=None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_num_batched_tokens: int | None = None,
    gpu_memory_gib: float | None = None,
    gpu_memory_utilization: float = 0.8,
    dtype_bytes: int = 2,
    num_samples: int | None = None,
    avg_tokens: float | None = None,
    total_tokens: int | None = None,
    max_model_len: int = 2048,
    batch_size: int | None = None,
    queue_size: int = 2,
    max_batch_tokens: int | None = None,
    parts: int = 1,
    layer_id_convention: str | None = None,
    fmt: str | None = None,
    states_dtype: str = "auto",
) -> Plan:
    from ..layers import resolve as resolve_layers

    cfg = _read_config(model)
    t = text_config(cfg)
    info = count_params(cfg)
    tp = tensor_parallel_size
    h, n = info["hidden"], info["layers"]
    ids = resolve_layers(layer_ids, n, layer_id_convention, fmt)
    qz, qdesc = quantization_of(cfg)
    total, quant, wbytes_total, wbytes_gpu = weight_bytes(info, qz, dtype_bytes, tp)
    kv = kv_bytes_per_token(t, info, tp, dtype_bytes)
    mnbt = max_num_batched_tokens or max(8192, max_model_len)
    hidden_per_token = state_bytes_per_token(len(ids), h, dtype_bytes, states_dtype)
    capture_step = mnbt * len(ids) * h * dtype_bytes  # (FP8 too: a step is quantized once all its rows are in)
    gpu_bytes = int((gpu_memory_gib or _detect_gpu_gib() or 141.0) * GiB)
    # activation peak of one prefill step, rough: a few hidden-sized buffers per token plus logits
    activation = mnbt * (8 * h + (t["vocab_size"] // tp)) * 4
    kv_budget = int(gpu_bytes * gpu_memory_utilization - wbytes_gpu - activation - capture_step)
    stages = stage_figures(info, t, ids, tp, pipeline_parallel_size, dtype_bytes, qz, mnbt)
    if stages:  # each stage's GPUs hold its layers: the fullest stage binds
        wbytes_gpu, kv, kv_budget, capture_step = _fit_stages(stages, gpu_bytes * gpu_memory_utilization - activation)
    notes = _notes(qdesc, mnbt, activation, info, dtype_bytes, kv_budget)
    if total_tokens is None and num_samples and avg_tokens:
        total_tokens = int(num_samples * avg_tokens)
    per_token_disk = disk_bytes_per_token(len(ids), h, dtype_bytes, states_dtype)
    ds = _dataset_sizes(num_samples, total_tokens, hidden_per_token, per_token_disk)
    both = _by_states_dtype(len(ids), h, dtype_bytes, num_samples, total_tokens)
    handoff_tokens, handoff = _handoff(batch_size, max_batch_tokens, max_model_len, queue_size, hidden_per_token)
    return Plan(
        model=str(model),
        architecture=(cfg.get("architectures") or ["?"])[0],
        num_layers=n,
        hidden_size=h,
        layer_ids=ids,
        tensor_parallel_size=tp,
        params_total=int(total),
        params_quantized=int(quant),
        weight_bytes_total=int(wbytes_total),
        weight_bytes_per_gpu=int(wbytes_gpu),
        kv_bytes_per_token_per_gpu=int(kv),
        tokens_per_step=mnbt,
        capture_bytes_per_step=int(capture_step),
        hidden_bytes_per_token=hidden_per_token,
        disk_bytes_per_token=per_token_disk,
        gpu_memory_bytes=gpu_bytes,
        kv_cache_bytes_per_gpu=max(kv_budget, 0),
        kv_cache_tokens=max(kv_budget, 0) // max(kv, 1),
        notes=notes,
        dataset=ds,
        batch_size=batch_size,
        handoff_batch_tokens=handoff_tokens,
        handoff_bytes=handoff,
        parts=parts,
        states_dtype=states_dtype,
        by_states_dtype=both,
        pipeline_parallel_size=pipeline_parallel_size,
        stages=stages,
    )


def _detect_gpu_gib() -> float | None:
    try:
        import torch

        from ..host import cuda_device_count

        if cuda_device_count() > 0:  # not is_available(): that would poison fork for a later engine
            return torch.cuda.get_device_properties(0).total_memory / GiB
    except ImportError:
        return None
    return None


def format_plan(p: Plan) -> str:
    def gib(b):
        return f"{b / GiB:,.1f} GiB ({b / GB:,.1f} GB)"

    lines = [
        f"plan for {p.model} ({p.architecture}), tensor parallel {p.tensor_parallel_size}"
        + (
            f" x pipeline parallel {p.pipeline_parallel_size} ({p.tensor_parallel_size * p.pipeline_parallel_size} GPUs)"
            if p.stages
            else ""
        ),
        f"  layers {p.num_layers}, hidden {p.hidden_size}, capture layer ids {p.layer_ids}",
        f"  parameters: {p.params_total / 1e9:,.1f} B ({p.params_quantized / 1e9:,.1f} B quantized)",
        f"  weights: total {gib(p.weight_bytes_total)}; per GPU {gib(p.weight_bytes_per_gpu)}",
        f"  GPU memory {gib(p.gpu_memory_bytes)} per GPU; KV cache left {gib(p.kv_cache_bytes_per_gpu)} "
        f"= {p.kv_cache_tokens:,} tokens at {p.kv_bytes_per_token_per_gpu:,} B/token/GPU",
        f"  per step: {p.tokens_per_step:,} tokens; capture buffers {gib(p.capture_bytes_per_step)} on GPU",
        f"  hidden states ({p.states_dtype}): {p.hidden_bytes_per_token:,} B per token ({len(p.layer_ids)} layers x "
        f"{p.hidden_size} x {'1 B + a 4 B scale' if p.states_dtype == 'fp8' else '2 B'})",
        "  by --states-dtype: "
        + "; ".join(
            f"{sd} {b['hidden_bytes_per_token']:,} B/token"
            + (f", disk {gib(b['disk_bytes'])}" if "disk_bytes" in b else "")
            for sd, b in p.by_states_dtype.items()
        ),
        f"  output disk: {p.disk_bytes_per_token * 1000 / 1e6:,.1f} MB/s for each 1,000 tokens/s extracted "
        f"(the pipeline goes no faster than its output disk writes)",
    ]
    lines += _stage_lines(p, gib)
    if p.handoff_bytes is not None:
        lines.append(
            f"  host hand-off (/dev/shm on TP rank 0's host, page-locked on a GPU): up to "
            f"{gib(p.handoff_bytes)} while extracting (largest batch {p.handoff_batch_tokens:,} "
            f"tokens; docker: --shm-size or --ipc=host)"
        )
    if p.dataset:
        d = p.dataset
        lines.append(
            f"  dataset: {d['samples'] or '?'} samples, {d['tokens']:,} tokens -> hidden states "
            f"{gib(d['hidden_state_bytes'])}; disk needed {gib(d['disk_bytes'])}"
        )
    if p.parts > 1:
        share = (
            f"~{-(-d['samples'] // p.parts):,} samples, {gib(d['disk_bytes'] // p.parts)} of output"
            if (d := p.dataset) and d.get("samples")
            else f"1/{p.parts} of the samples and of the output"
        )
        lines.append(
            f"  in {p.parts} parts (ranks): each {share} and {p.tensor_parallel_size} GPU(s); the "
            f"output disk takes the sum of their rates ({p.disk_bytes_per_token * 1000 / 1e6:,.1f} MB/s "
            "per 1,000 tokens/s of each part)"
        )
    lines += [f"  note: {x}" for x in p.notes]
    return "\n".join(lines)


def _stage_lines(p: Plan, gib) -> list[str]:
    """One line a pipeline stage: its layers, what it captures, its memory per GPU."""
    lines = []
    for st in p.stages:
        a, b = st["layers"]
        lines.append(
            f"  stage {st['stage']}: layers {a}..{b - 1}, captures {st['captures'] or 'none'}; per GPU: weights "
            f"{gib(st['weight_bytes_per_gpu'])}, KV cache left {gib(st['kv_cache_bytes_per_gpu'])} = "
            f"{st['kv_cache_tokens']:,} tokens, capture buffers {gib(st['capture_bytes_per_step'])}"
        )
    if p.stages:
        lines.append(
            "  (vLLM's split of the layers; VLLM_PP_LAYER_PARTITION sets another. Each stage's first GPU "
            "captures its layers; the last stage runs the self-check. Above: the fullest stage's figures)"
        )
    return lines


def main_plan(args) -> int:
    total_tokens = num = None
    if getattr(args, "input", None):
        from .dataset import open_dataset

        num = total_tokens = 0
        batch_size = getattr(args, "batch_size", None) or 1
        max_batch = in_batch = 0
        for s in open_dataset(args.input):
            if getattr(args, "max_samples", None) and num >= args.max_samples:
                break
            if num % batch_size == 0:
                in_batch = 0
            num += 1
            n = min(len(s.input_ids), args.max_model_len - 1)
            total_tokens += n
            in_batch += n
            max_batch = max(max_batch, in_batch)
    p = make_plan(
        args.model,
        layer_ids=args.layer_ids,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_gib=getattr(args, "gpu_memory_gib", None),
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_samples=num or getattr(args, "num_samples", None),
        avg_tokens=getattr(args, "avg_tokens", None),
        total_tokens=total_tokens or None,
        max_model_len=args.max_model_len,
        batch_size=getattr(args, "batch_size", None),
        queue_size=getattr(args, "queue_size", 2),
        max_batch_tokens=max_batch if getattr(args, "input", None) else None,
        parts=(getattr(args, "world_size", None) or 1) * (getattr(args, "data_parallel_size", None) or 1),
        layer_id_convention=getattr(args, "layer_id_convention", None),
        fmt=getattr(args, "format", None),
        states_dtype=getattr(args, "states_dtype", "auto"),
    )
    print(json.dumps(asdict(p), indent=2) if getattr(args, "json", False) else format_plan(p))
    return 0

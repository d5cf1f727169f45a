"""Which captured rows belong to which request, and at which positions: the correctness claim.

Every forward, the model runner gives the order of the requests in the flattened token batch (the
V1 runner: its persistent ``input_batch``; Model Runner V2: the ``InputBatch`` its ``prepare_inputs``
builds for the step, requests sorted by token count), the step's ``SchedulerOutput`` how many
tokens each one has, and the ``positions`` input each segment's token positions. Rows are kept
under (request id, start position); rows past a prompt's length (a decode step) are dropped;
nothing is attributed by offset across requests. A request's segments, ordered by position, must
cover 0..len-1 exactly once (``coverage_problem``).
"""

from __future__ import annotations

from typing import Any

import torch


def runner_kind(runner) -> str:
    """Where a runner keeps the order of requests in a step: ``"v1"`` (the V1 runner's persistent
    ``input_batch``, vLLM 0.11-0.33) or ``"v2"`` (Model Runner V2, opt-in before 0.34 and the only
    runner from 0.34: ``prepare_inputs`` builds a fresh ``InputBatch`` for each step)."""
    if hasattr(runner, "input_batch"):
        return "v1"
    if callable(getattr(runner, "prepare_inputs", None)):
        return "v2"
    raise RuntimeError(
        f"speculators_compat: the model runner {type(runner).__name__} has neither an `input_batch` "
        "(vLLM's V1 runner) nor a `prepare_inputs` method (Model Runner V2): capture cannot tell which "
        "rows of a step belong to which request. This vLLM is not supported."
    )


def step_requests(runner, st, so) -> tuple[list, list, Any] | None:
    """(request ids in the order of the step's flattened tokens, tokens each, a fallback for
    their start positions) or None when the forward is not a scheduled step."""
    if st.runner_kind == "v2":
        b = st.step_batch
        if b is None:
            return None  # a forward outside prepare_inputs: dummy / profiling run
        n = int(b.num_reqs)
        req_ids = list(b.req_ids[:n])
        counts = [int(so.num_scheduled_tokens.get(r, 0)) for r in req_ids]
        own = [int(x) for x in b.num_scheduled_tokens[:n]]
        if own != counts:
            raise RuntimeError(
                "speculators_compat: the step's input batch and the scheduler disagree on how many "
                f"tokens each request has ({dict(zip(req_ids, own))} vs {dict(zip(req_ids, counts))}); "
                "rows cannot be attributed safely"
            )
        computed = getattr(b, "num_computed_tokens_np", None)
        return req_ids, counts, (lambda i: int(computed[i])) if computed is not None else None
    ib = runner.input_batch
    req_ids = list(ib.req_ids[: ib.num_reqs]) if hasattr(ib, "num_reqs") else list(ib.req_ids)
    counts = [int(so.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    return req_ids, counts, lambda i: int(ib.num_computed_tokens_cpu[i])


def scheduler_order(req_ids, counts, so, device):
    """Upstream's record-everything contract hands back a step's rows in the order its requests
    were scheduled (the V1 runner runs them in that order; upstream's generator slices by it).
    Model Runner V2 runs them sorted by token count: an index that puts the rows back in the
    scheduler's order, or None when they already are."""
    where, offset = {}, 0
    for rid, n in zip(req_ids, counts):
        where[rid] = (offset, n)
        offset += n
    wanted = [r for r in so.num_scheduled_tokens if r in where]
    if wanted == list(req_ids):
        return None
    idx = torch.cat([torch.arange(where[r][0], where[r][0] + where[r][1]) for r in wanted])
    return idx.to(device) if device is not None else idx


def plan_rows(st, req_ids, counts, starts, device, arena_order: bool | None = None):
    """Which rows of this forward to keep: prompt rows of announced requests, nothing else.

    Returns (source, kept) where ``source`` selects the kept rows from the layer output (a slice
    when they are one contiguous run, else an index tensor) and ``kept`` lists (request, start
    position, rows, first row in the compacted block).

    ``arena_order`` (default: on a GPU) takes the kept rows in announcement order, the order of
    the requests' regions in the arena: Model Runner V2 orders a step's requests by token count,
    and rows taken in step order would then need one device->host copy per request instead of one
    per layer. (On a CPU the rows are added into the arena run by run, no gather first.)
    """
    entries, offset = [], 0  # (request, start, rows, offset in the step)
    for rid, n, start in zip(req_ids, counts, starts):
        plen = st.expected.get(rid)
        if n and plen is not None and start < plen:
            entries.append((rid, start, min(n, plen - start), offset))
        offset += n
    if not entries:
        return None
    if arena_order is None:
        arena_order = device is not None and device.type == "cuda"
    if arena_order:
        entries.sort(key=lambda e: st.order.get(e[0], -1))  # stable: V1 steps keep their order
    kept, ranges, row = [], [], 0
    for rid, start, keep, off in entries:
        kept.append((rid, start, keep, row))
        ranges.append((off, off + keep))
        row += keep
    if all(a == b for (_, a), (b, _) in zip(ranges, ranges[1:])):
        source = slice(ranges[0][0], ranges[-1][1])
    else:
        idx = torch.cat([torch.arange(a, b) for a, b in ranges])
        source = idx.to(device) if device is not None else idx
    return source, kept


def merge_adjacent(blocks: list, row_bytes: int) -> list:
    """(buffer, offset, rows) blocks in position order, each run of blocks that lie back to back
    in one buffer merged into one block (the same bytes, in the same order)."""
    out = []
    for b, o, n in blocks:
        if out and out[-1][0] == b and out[-1][1] + out[-1][2] * row_bytes == o:
            out[-1] = (b, out[-1][1], out[-1][2] + n)
        else:
            out.append((b, o, n))
    return out


def step_starts(positions: torch.Tensor, counts: list[int], req_ids: list) -> list[int]:
    """Each request's first position in a step, from the step's 1-D ``positions`` input, checked:
    every request's rows must hold consecutive positions, else attribution would be wrong."""
    total = sum(counts)
    pos = positions[:total].to("cpu", non_blocking=False).long()  # one device->host copy per step
    cnt = torch.tensor(counts, dtype=torch.long)
    offsets = torch.cumsum(cnt, 0) - cnt
    starts_t = pos[offsets.clamp(max=total - 1)]
    expected = torch.repeat_interleave(starts_t, cnt) + torch.arange(total) - torch.repeat_interleave(offsets, cnt)
    if not torch.equal(pos, expected):
        bad_row = int((pos != expected).nonzero()[0])
        owner = int(torch.searchsorted(torch.cumsum(cnt, 0), bad_row, right=True))
        raise RuntimeError(
            f"speculators_compat: request {req_ids[owner]}: positions of its rows are not "
            "contiguous (attribution would be wrong)"
        )
    return starts_t.tolist()


def coverage_problem(starts_and_rows: list[tuple[int, int]], prompt_len: int) -> str | None:
    """Why a request's captured segments ((start, rows), sorted by start) do not cover positions
    0..prompt_len-1 exactly once, or None when they do."""
    pos = 0
    for start, n in starts_and_rows:
        if start != pos:
            return (
                f"positions {pos}..{start - 1} missing"
                if start > pos
                else f"positions {start}..{min(pos, start + n) - 1} captured twice"
            )
        pos += n
    if pos != prompt_len:
        return f"captured {pos} of {prompt_len} prompt positions"
    return None

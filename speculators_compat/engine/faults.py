"""Faults made on purpose in a worker's capture, for tests only: the seam that shows the
self-check (witness.py) and the HF comparisons catch a wrong capture.

A test asks for one with the ``compat_inject_fault`` RPC; the capture state then holds a
:class:`Fault` (None in use, so the capture path only ever asks ``st.fault is not None``):

- ``swap``: the rows of the first two requests of a step that have as many rows at the same
  positions are exchanged (coverage still holds);
- ``zero``: zeros are stored instead of the rows;
- ``shift``: each row is stored one position late (position p gets the row of p - 1);
- ``nan``: the first kept row of every step is stored as NaN.

The model's own computation is never touched: vLLM still samples from the right states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FAULTS = ("swap", "zero", "shift", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str

    def layout(self, req_ids: list, counts: list, starts: list) -> list:
        """The step's request order as the capture sees it."""
        if self.kind != "swap":
            return req_ids
        for i in range(len(req_ids) - 1):
            if counts[i] and counts[i] == counts[i + 1] and starts[i] == starts[i + 1]:
                out = list(req_ids)
                out[i], out[i + 1] = out[i + 1], out[i]
                return out
        return req_ids

    def plan(self, plan, device):
        """The step's plan of which rows are kept, as the capture uses it."""
        if self.kind != "shift" or plan is None:
            return plan
        source, kept = plan
        idx = torch.arange(source.start, source.stop, device=device) if isinstance(source, slice) else source
        return (idx - 1).clamp(min=0), kept

    def rows(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kept rows (and their residual) to store: new tensors, the layer's output is the model's."""
        if self.kind == "zero":
            return torch.zeros_like(hidden), None
        if self.kind == "nan":
            hidden = hidden.clone()
            hidden[0] = float("nan")
        return hidden, residual

    def last_rows(self, pick: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """(request, row) of each request's last position, for the row the self-check keeps."""
        return [(rid, max(r - 1, 0)) for rid, r in pick] if self.kind == "shift" else pick


def inject_fault(worker, kind: str | None) -> None:
    """Make this worker's capture wrong on purpose (module docstring); None: capture as it should."""
    if kind is not None and kind not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS} or None, not {kind!r}")
    st = getattr(worker, "_compat_capture", None)
    if st is not None:
        st.fault = Fault(kind) if kind is not None else None

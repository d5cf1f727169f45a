"""Pipeline stages, driver side: which worker captures which layers, and a batch's rows put
together from every stage's reply, in the caller's layer order.

Under pipeline parallelism each stage's first tensor-parallel rank captures the layers its stage
computes (capture.py), and the last stage's ranks run the self-check (the final norm and lm_head
live there). Each such worker hands its rows back on its own: through its /dev/shm arena when it
shares the driver's /dev/shm, else pickled in its reply over vLLM's RPC (a worker on another host).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageMap:
    """What the workers said at set-up: per stage, the captured layers it computes and how its rows
    travel ("shm" or "rpc")."""

    layers: dict  # stage -> [layer ids], in the caller's order
    handoff: dict  # stage -> "shm" | "rpc"
    ranges: dict  # stage -> [first, end) of the decoder layers it computes, as vLLM split them
    stages: int  # pipeline-parallel size

    @classmethod
    def from_infos(cls, infos: list, layer_ids: list) -> StageMap:
        """From ``compat_capture_setup``'s replies (one a worker); every requested layer must be
        computed by exactly one stage."""
        layers, handoff, ranges = {}, {}, {}
        for i in infos:
            if i.get("stage_layers") and i.get("capturing"):
                layers[i["stage"]] = list(i["stage_layers"])
                handoff[i["stage"]] = i.get("handoff", "shm")
                ranges[i["stage"]] = list(i.get("layer_range") or ())
        owners = {}
        for s, lids in layers.items():
            for lid in lids:
                owners.setdefault(lid, set()).add(s)
        missing = [lid for lid in layer_ids if lid not in owners]
        if missing:
            raise RuntimeError(f"speculators_compat: no pipeline stage captures layer(s) {missing}")
        twice = sorted(lid for lid, s in owners.items() if len(s) > 1)
        if twice:
            raise RuntimeError(f"speculators_compat: layer(s) {twice} are captured by more than one stage")
        stages = max((int(i.get("stages", 1)) for i in infos), default=1)
        return cls(layers, handoff, ranges, stages)

    @property
    def single(self) -> bool:
        """One stage captures every layer (no pipeline parallelism): only rank 0's reply counts."""
        return self.stages == 1

    def describe(self) -> list[dict]:
        return [
            {"stage": s, "layers": self.layers[s], "handoff": self.handoff[s], "range": self.ranges[s]}
            for s in sorted(self.layers)
        ]


def merge(replies: list, layer_ids: list, req_ids: list) -> dict:
    """One take reply from every worker's (``compat_capture_take``): each request's entries in
    ``layer_ids`` order, a stage's errors named by stage, the self-check's verdict from the stage
    that ran it, every stage's arena files."""
    parts = [r for r in replies if r and r.get("rank_captures")]
    out = {"states": {}, "errors": {}, "slabs": [], "fp8": False}
    for p in parts:
        out["slabs"].extend(p.get("slabs") or ())
        for rid, msg in p["errors"].items():
            out["errors"].setdefault(rid, f"pipeline stage {p.get('stage', 0)}: {msg}")
        if p.get("self_check") is not None:
            out["self_check"] = p["self_check"]
        if p.get("layer_ids"):
            out["hidden"], out["dtype"] = p["hidden"], p["dtype"]
    for rid in req_ids:
        if rid in out["errors"]:
            continue
        by_layer = {}
        for p in parts:
            for lid, entry in zip(p.get("layer_ids") or (), p["states"].get(rid) or ()):
                by_layer[lid] = entry
        out["states"][rid] = [by_layer[lid] for lid in layer_ids]
    return out

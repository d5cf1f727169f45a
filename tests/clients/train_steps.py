"""A few optimizer steps of an installed speculators release's EAGLE-3 draft, on the CPU, over
extracted data, through that release's own data classes (its dataset, batch sampler and collate).

    python tests/clients/train_steps.py --data DIR --verifier MODEL [--steps 3] [--format pt|hs]

``--format pt``: ``data_{i}.pt`` files read by ``Eagle3SampleFileDataset`` (0.3.x, 0.4.x);
``--format hs``: a dataset directory with ``hidden_states/hs_{i}.safetensors`` read by
``ArrowDataset`` (0.5+), through its ``file`` hidden-states backend or (``--backend fp8``) its
``fp8`` one; with ``--endpoint URL`` its ``--on-missing generate`` asks that server for every row
without a file. ``--compare DIR``: the same samples from another output, read the same way; the worst
per-sample relative error between the two is reported. Prints one ``TRAIN {json}`` line: the loss
per step and what was read.

Why not the release's own ``Trainer``: it places the model on ``torch.device(local_rank)``, i.e.
CUDA device 0 (its ``setup_model`` calls ``to_empty(device="cuda")``), so it cannot run here; the
loop below is its ``train_epoch`` step (forward, backward, clip, AdamW step) on the CPU.
Run it with ``TORCHDYNAMO_DISABLE=1`` on the CPU: 0.3.0's draft forward is ``@torch.compile``d, and
Inductor's CPU build of it failed on a host with AMX tiles (``InductorError: IndexError: tuple index
out of range``, torch 2.10); 0.4.0 compiles it only when CUDA is available, so both run it eagerly.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def layer_config(verifier: str, num_layers: int = 1):
    """The draft's one decoder layer, shaped like the verifier's (as the releases' train.py build it)."""
    from transformers import AutoConfig, LlamaConfig

    v = AutoConfig.from_pretrained(verifier)
    layer = LlamaConfig(
        vocab_size=v.vocab_size,
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=v.num_attention_heads,
        num_key_value_heads=v.num_key_value_heads,
        hidden_act=v.hidden_act,
        max_position_embeddings=v.max_position_embeddings,
        initializer_range=v.initializer_range,
        rms_norm_eps=v.rms_norm_eps,
    )
    layer._attn_implementation = "simple_flex_attention"
    return v.vocab_size, layer


def draft_model_03(verifier: str):
    """speculators 0.3.x/0.4.x: ``Eagle3DraftModel(config, t2d, d2t)``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    vocab, layer = layer_config(verifier)
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=vocab,
        norm_before_residual=True,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy", speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"]),
        ),
    )
    return Eagle3DraftModel(
        config=cfg, t2d=torch.ones(vocab, dtype=torch.bool), d2t=torch.zeros(vocab, dtype=torch.long)
    )


def draft_model_05(verifier: str, target_layer_ids: list[int]):
    """speculators >= 0.5: ``Eagle3DraftModel.from_training_args`` (what its train CLI calls)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    vocab, layer = layer_config(verifier)
    return Eagle3DraftModel.from_training_args(
        layer,
        t2d=torch.ones(vocab, dtype=torch.bool),
        d2t=torch.zeros(vocab, dtype=torch.long),
        draft_vocab_size=vocab,
        norm_before_residual=True,
        ttt_steps=3,
        verifier_name_or_path=verifier,
        target_layer_ids=target_layer_ids,
        # its --draft-attn-impl: FlexAttention (the default) has no backward on the CPU in torch 2.13
        draft_attn_impl="sdpa",
    )


def loader(
    fmt: str, data: str, max_len: int, hidden_size: int, aux: int, backend: str = "file", endpoint: str | None = None
):
    from speculators.train import data as sd
    from torch.utils.data import DataLoader

    if fmt == "pt":
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

        dataset = sd.Eagle3SampleFileDataset(file_list=sorted(sd.list_files(data)), max_len=max_len)
        sampler = MultipackDistributedBatchSamplerV2(
            batch_max_length=max_len, lengths=dataset.approx_lengths, num_replicas=1, rank=0
        )
        return dataset, DataLoader(dataset, batch_sampler=sampler, collate_fn=sd.create_collate_fn(max_len))
    import argparse
    from pathlib import Path

    from hs_connectors import HiddenStatesBackend

    # the backend as its trainer (train/cli.py) builds it from --hidden-states-backend
    cls = HiddenStatesBackend.registry[backend]
    transfer = cls.from_train_args(argparse.Namespace(hidden_states_path=None), data)
    assert Path(transfer.hidden_states_path) == Path(data) / "hidden_states"
    gen = {"on_missing": "generate", "vllm_endpoint": endpoint} if endpoint else {"on_missing": "raise"}
    dataset = sd.ArrowDataset(
        max_len=max_len, datapath=data, hidden_states_dtype=torch.float32, transfer=transfer, **gen
    )
    collate = sd.CollateFn(max_len, hidden_size=hidden_size, num_target_layers=aux, dtype=torch.float32)
    return dataset, DataLoader(dataset, batch_size=2, collate_fn=collate)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--format", choices=("pt", "hs"), default="pt")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--target-layer-ids", default="2,3,4", help="hs: the draft's aux layers (vLLM ids)")
    ap.add_argument("--backend", choices=("file", "fp8"), default="file", help="hs: its hidden-states backend")
    ap.add_argument("--compare", default=None, help="another output of the same samples (see above)")
    ap.add_argument(
        "--endpoint",
        default=None,
        help="hs: a server's /v1 URL: rows without a file are generated through it (--on-missing generate)",
    )
    a = ap.parse_args()

    from importlib.metadata import version

    from transformers import AutoConfig

    import speculators_compat  # noqa: F401  (speculators 0.3.x needs its transformers 5 shims)

    torch.manual_seed(0)
    aux = [int(x) for x in a.target_layer_ids.split(",")]
    model = draft_model_03(a.verifier) if a.format == "pt" else draft_model_05(a.verifier, aux)
    model = model.to(torch.float32)
    hidden = AutoConfig.from_pretrained(a.verifier).hidden_size
    dataset, dl = loader(a.format, a.data, a.max_len, hidden, len(aux), a.backend, a.endpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    losses, shapes = [], None
    call = {"ttt_steps": 3, "use_off_policy_tokens": False}
    if a.format == "hs":  # its trainer's own call kwargs; --loss-implementation eager (the fused loss is Triton's)
        call, _ = type(model).get_trainer_kwargs(
            loss_fn="kl_div", loss_implementation="eager", ttt_steps=3, ttt_step_loss_decay=1.0
        )
    batches = iter(dl)
    first = None
    for _ in range(a.steps):
        batch = first if first is not None else next(batches)
        first = batch  # the same batch each step: its loss must fall
        shapes = shapes or {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        batch = {k: (v.float() if "hidden_states" in k else v) for k, v in batch.items()}
        _draft, loss, _metrics = model(**batch, **call)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    out = {
        "speculators": version("speculators"),
        "samples": len(dataset),
        "losses": losses,
        "finite": all(map(math.isfinite, losses)),
        "batch": shapes,
    }
    out["approx_lengths"] = list(map(int, dataset.approx_lengths))
    # every sample through the release's own __getitem__ (0.5+: a row whose file is missing or whose
    # token ids differ comes back as SampleUnavailable)
    items = [dataset[i] for i in range(len(dataset))]
    out["unavailable"] = sum(not isinstance(x, dict) for x in items)
    out["loss_mask_sums"] = [int(x["loss_mask"].sum()) for x in items if isinstance(x, dict)]
    if a.compare:  # (read by the same class, with its default backend)
        other, _ = loader(a.format, a.compare, a.max_len, hidden, len(aux))
        errs = []
        for x, i in zip(items, range(len(other))):
            y = other[i]
            for k in ("hidden_states", "verifier_last_hidden_states"):
                errs.append(float((x[k].float() - y[k].float()).norm() / y[k].float().norm().clamp_min(1e-12)))
        out["max_relative_error_vs_compare"] = max(errs)
    print("TRAIN " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""The LoRA side of a training run: adapters on the actor, the reference for free, adapter-only
checkpoints and the weights the rollout servers get.

* :func:`attach_lora` (called by :class:`~areal_mega.engine.MegatronEngine` before the DDP wrap)
  checks the model family and layout, then adds the adapters; the base stays frozen, so the
  gradient buffers and the (distributed) optimizer hold the adapters alone.
* :class:`AdaptersOffReference`: ``ref_logprobs`` from the actor with its adapters off, no
  second model.
* :func:`adapter_keys` / :func:`base_keys`: the sharded-state-dict filters of a LoRA checkpoint
  (adapters and optimizer only; the base comes from ``model.path``, whose identity the
  checkpoint records, :func:`checkpoint_extra`).
* :func:`publish_adapter` writes a PEFT directory (``lora.sync: adapter``); :func:`merged_deltas`
  gives the ``scale · B @ A`` of each adapted HF weight for a merged export (``lora.sync:
  merged``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from areal_mega.lora.targets import canonical_targets, check_lora_support, hf_targets

__all__ = [
    "LoraState",
    "attach_lora",
    "AdaptersOffReference",
    "adapter_keys",
    "base_keys",
    "publish_adapter",
    "merged_deltas",
    "checkpoint_extra",
    "check_resumed_base",
]


@dataclass
class LoraState:
    """The adapters of an engine: rank, alpha, dropout, PEFT targets, sync mode and how many
    parameters train on this rank."""

    rank: int
    alpha: float
    dropout: float
    targets: List[str]
    sync: str = "adapter"
    n_trainable: int = 0
    n_frozen: int = 0
    extra: dict = field(default_factory=dict)


def attach_lora(engine, chunks, lora_cfg) -> Optional[LoraState]:
    """Add LoRA adapters to ``chunks`` (bare, before DDP) when ``lora_cfg.enabled``; returns
    their :class:`LoraState`, or None. Raises
    :class:`~areal_mega.lora.targets.LoraSupportError` for a family or layout not served."""
    if lora_cfg is None or not getattr(lora_cfg, "enabled", False):
        return None
    from areal_mega.lora.layers import apply_lora, trainable_parameter_count

    arch, dims = engine.arch, engine.mesh.dims
    vl = bool(getattr(engine, "is_vl", False))  # a vision-language model (its tower frozen)
    targets = hf_targets(lora_cfg.target_modules)
    check_lora_support(
        model_type=arch.model_type,
        is_moe=bool(arch.num_experts),
        is_mla=arch.is_mla,
        targets=targets,
        rank=lora_cfg.rank,
        tp=dims.tp,
        cp=dims.cp,
        gated_mlp=arch.gated_mlp,
        linear_attention=arch.linear_attention_layers is not None,
        hybrid=arch.has_mamba,
        vision_language=vl,
    )
    n_all = sum(p.numel() for c in chunks for p in c.parameters())
    n = apply_lora(
        # a vision-language model: adapters on its language model; everything else frozen
        [c.language_model for c in chunks] if vl else chunks,
        rank=lora_cfg.rank,
        alpha=lora_cfg.alpha,
        dropout=lora_cfg.dropout,
        targets=canonical_targets(targets),
    )
    if vl:
        for c in chunks:
            for name, p in c.named_parameters():
                if ".adapter." not in name:
                    p.requires_grad_(False)
        n = trainable_parameter_count(chunks)
    return LoraState(
        rank=lora_cfg.rank,
        alpha=float(lora_cfg.alpha),
        dropout=float(lora_cfg.dropout),
        targets=targets,
        sync=getattr(lora_cfg, "sync", "adapter"),
        n_trainable=n,
        n_frozen=n_all,
    )


class AdaptersOffReference:
    """The reference model of a LoRA run: the actor's ``forward_logprobs`` with every adapter
    switched off (the frozen base, exactly)."""

    def __init__(self, actor):
        self.actor = actor
        self.shares_prompt_prefix = actor.shares_prompt_prefix

    def forward_logprobs(self, micro_batches, **kw):
        from areal_mega.lora.layers import adapters_disabled

        with adapters_disabled(self.actor.model):
            return self.actor.forward_logprobs(micro_batches, **kw)


def adapter_keys(key: str) -> bool:
    """Sharded-state-dict keys of the LoRA adapters."""
    return ".adapter." in key


def base_keys(key: str) -> bool:
    """Sharded-state-dict keys of everything but the adapters."""
    return ".adapter." not in key


def checkpoint_extra(state: LoraState, base_identity: dict) -> dict:
    """What a LoRA checkpoint records about its adapters and the base model they apply to."""
    return {
        "rank": state.rank,
        "alpha": state.alpha,
        "targets": state.targets,
        "base_model": base_identity.get("hf_dir"),
        "base_identity": base_identity,
    }


def check_resumed_base(saved: dict, base_identity: dict, where) -> None:
    """Refuse to resume adapters trained on another base model or with another shape."""
    if not saved:
        raise ValueError(
            f"{where}: not a LoRA checkpoint (no 'lora' record); it holds full "
            "weights — resume it with lora.enabled=false"
        )
    mine = {k: base_identity.get(k) for k in ("config_sha256", "weights")}
    theirs = {k: (saved.get("base_identity") or {}).get(k) for k in mine}
    if mine != theirs:
        raise ValueError(
            f"{where}: its adapters were trained on {saved.get('base_model')!r}, "
            f"whose files differ from model.path {base_identity.get('hf_dir')!r}"
        )


def publish_adapter(engine, out, *, base_model: str, is_writer: bool):
    """Write the actor's adapters as a PEFT directory at ``out`` (collective)."""
    from areal_mega.checkpoint.export import is_export_source
    from areal_mega.lora.peft_io import adapter_config, write_peft_adapter

    st = engine.lora
    cfg = adapter_config(
        rank=st.rank, alpha=st.alpha, dropout=st.dropout, targets=st.targets, base_model=base_model
    )
    return write_peft_adapter(
        engine.model,
        engine.arch,
        out,
        config=cfg,
        is_writer=is_writer,
        is_source=is_export_source(),
    )


def merged_deltas(engine) -> Dict[str, torch.Tensor]:
    """``{HF weight name: (alpha / r) · B @ A}`` of this pipeline stage's adapted weights
    (fp32, full; collective over the TP group)."""
    from areal_mega.lora.peft_io import iter_peft_tensors, peft_deltas

    st = engine.lora
    return peft_deltas(
        dict(iter_peft_tensors(engine.model, engine.arch, rank=st.rank)),
        rank=st.rank,
        alpha=st.alpha,
    )

"""LoRA adapters in the Megatron model, from Megatron-Bridge's canonical LoRA.

:func:`apply_lora` freezes the base weights and wraps the targeted linears with Megatron-Bridge's
``CanonicalLoRA`` (one adapter per HF projection, so adapters map 1:1 to PEFT's): its
``ParallelLinearAdapter`` pairs are tensor-parallel (the A/B split follows the base linear:
column-parallel bases split A on its rank dimension and B on its output, row-parallel bases
split A on its input) and handle sequence parallelism. Apply it before the DDP wrap: the
gradient buffers and the optimizer then hold the adapters alone.

Two pieces of the bridge are replaced (:class:`SplitQKVLoRA`, :class:`SplitFC1LoRA`): its
fused-QKV wrapper reshapes the q/k/v adapter outputs with the *global* head counts, so on a TP
shard it fails unless the token count is a multiple of TP (packed batches without sequence
parallelism are not padded to one), and its QKV and gate/up wrappers call every adapter slot,
so a subset such as ``q_proj, v_proj`` fails (and so does the bridge's checkpoint walk over
the empty slots). Ours use the shard's own head-group count and add nothing for an untargeted
projection; the gate/up one also checkpoints its adapters with plain TP sharding (the bridge
applies megatron's SwiGLU sharding to them, which makes a checkpoint TP-size dependent).

:func:`adapters_disabled` runs the model without its adapters: the reference model of a LoRA
run is the actor with the adapters off (no second model).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Sequence, Tuple

import torch

from areal_mega.compat.bridge_import import import_bridge_modules
from areal_mega.compat.te_placeholder import settle_bridge_peft_te_flags

# SplitQKVLoRA and SplitFC1LoRA come from the module __getattr__ (built on first use).
__all__ = [
    "import_canonical_lora",
    "apply_lora",
    "adapters_disabled",
    "adapter_wrappers",
    "SplitQKVLoRA",  # noqa: F822
    "SplitFC1LoRA",  # noqa: F822
    "trainable_parameter_count",
]


def import_canonical_lora():
    """Megatron-Bridge's ``(CanonicalLoRA, AdapterWrapper)``, imported through the checked
    TransformerEngine placeholder where TE is absent
    (:func:`areal_mega.compat.te_placeholder.settle_bridge_peft_te_flags`)."""
    from areal_mega.compat.megatron_cpu import install_te_placeholder

    install_te_placeholder()
    import_bridge_modules()  # the PEFT modules without every model family
    settle_bridge_peft_te_flags()
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA

    return CanonicalLoRA, AdapterWrapper


def _wrapper_base():
    return import_canonical_lora()[1]


def _adapter_out(adapters, slot: str, x):
    """The output of adapter ``slot`` on ``x``, or None when the projection has none."""
    return adapters[slot](x) if slot in adapters else None


class _SplitWrapperMixin:
    """``forward`` of a fused linear whose projections have adapters of their own."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias, ln_out = self.base_linear_forward(x, *args, **kwargs)
        if not self._adapter_enabled:
            return out, bias
        return out + self.fused_delta(ln_out, out), bias


def _make_split_classes():
    base = _wrapper_base()

    class SplitQKVLoRA(_SplitWrapperMixin, base):
        """``linear_qkv`` with separate q/k/v adapters (any subset), laid out like this TP
        shard of Megatron's fused QKV: per local query group, its query heads then k then v."""

        def fused_delta(self, ln_out, out):
            cfg = self.to_wrap.config
            hd = cfg.kv_channels
            per_group = cfg.num_attention_heads // cfg.num_query_groups
            groups = out.shape[-1] // ((per_group + 2) * hd)  # this TP shard's groups
            lead = out.shape[:-1]
            a = self.adapter
            q, k, v = (_adapter_out(a, n, ln_out) for n in ("adapter_q", "adapter_k", "adapter_v"))
            blocks = [
                out.new_zeros(*lead, groups, per_group * hd)
                if q is None
                else q.reshape(*lead, groups, per_group * hd),
                out.new_zeros(*lead, groups, hd) if k is None else k.reshape(*lead, groups, hd),
                out.new_zeros(*lead, groups, hd) if v is None else v.reshape(*lead, groups, hd),
            ]
            return torch.cat(blocks, dim=-1).reshape(*lead, -1)

    class SplitFC1LoRA(_SplitWrapperMixin, base):
        """``linear_fc1`` (gate and up fused, ``[gate_shard; up_shard]``) with separate gate/up
        adapters (either or both)."""

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """The base's entries, then each adapter's ``linear_in`` / ``linear_out`` with
            their plain row / column sharding. The bridge's adapter would store
            ``linear_out`` with megatron's SwiGLU sharding (meant for a fused gate/up
            output), which for these separate gate and up adapters puts the rows in a
            TP-dependent order: a checkpoint saved at TP2 would load wrong at TP1."""
            sd = self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata)
            for slot, adapter in self.adapter.items():
                for part in ("linear_in", "linear_out"):
                    sd.update(
                        getattr(adapter, part).sharded_state_dict(
                            f"{prefix}adapter.{slot}.{part}.", sharded_offsets, metadata
                        )
                    )
            return sd

        def fused_delta(self, ln_out, out):
            half = out.shape[-1] // 2
            gate = _adapter_out(self.adapter, "adapter_gate", ln_out)
            up = _adapter_out(self.adapter, "adapter_up", ln_out)
            zeros = out.new_zeros(*out.shape[:-1], half)
            return torch.cat([zeros if gate is None else gate, zeros if up is None else up], dim=-1)

    return SplitQKVLoRA, SplitFC1LoRA


_CLASSES: dict = {}


def _split_classes():
    if not _CLASSES:
        _CLASSES["qkv"], _CLASSES["fc1"] = _make_split_classes()
    return _CLASSES["qkv"], _CLASSES["fc1"]


def __getattr__(name):  # SplitQKVLoRA / SplitFC1LoRA, built on first use (bridge import)
    if name in ("SplitQKVLoRA", "SplitFC1LoRA"):
        return _split_classes()[0 if name == "SplitQKVLoRA" else 1]
    raise AttributeError(name)


def _canonical_lora_class():
    CanonicalLoRA, _ = import_canonical_lora()
    from megatron.bridge.peft.canonical_lora import (
        LoRALinearSplitFC1UpGate,
        LoRALinearSplitQKV,
        ModuleDict,
    )

    qkv_cls, fc1_cls = _split_classes()

    class TPCanonicalLoRA(CanonicalLoRA):
        """CanonicalLoRA whose fused QKV / gate-up wrappers are ours (see the module doc)."""

        def transform(self, m, name=None, prefix=None):
            if isinstance(m, (qkv_cls, fc1_cls)):
                return m
            out = super().transform(m, name, prefix)
            # the untargeted slots (None) are dropped: the bridge's checkpoint walk fails on them
            if type(out) is LoRALinearSplitQKV:
                return qkv_cls(out.to_wrap, ModuleDict(_present(out.adapter)))
            if type(out) is LoRALinearSplitFC1UpGate:
                return fc1_cls(out.to_wrap, ModuleDict(_present(out.adapter)))
            return out

    return TPCanonicalLoRA


def _present(adapters) -> dict:
    return {k: v for k, v in adapters.items() if v is not None}


def apply_lora(
    chunks: Sequence[torch.nn.Module],
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
) -> int:
    """Freeze ``chunks`` (bare GPTModel chunks, before DDP) and add LoRA adapters of ``rank`` on
    the canonical ``targets`` (:func:`areal_mega.lora.targets.canonical_targets`). B starts at
    zero (the model's output is unchanged), A with Xavier init. Returns the number of trainable
    parameters on this rank."""
    lora_cls = _canonical_lora_class()
    peft = lora_cls(
        target_modules=list(targets), dim=int(rank), alpha=float(alpha), dropout=float(dropout)
    )
    peft(list(chunks), training=True)
    return trainable_parameter_count(chunks)


def trainable_parameter_count(chunks: Sequence[torch.nn.Module]) -> int:
    """Parameters with ``requires_grad`` on this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)


def adapter_wrappers(chunk: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``(module name, wrapper)`` of every LoRA-wrapped linear of a bare model chunk."""
    base = _wrapper_base()
    for name, m in chunk.named_modules():
        if isinstance(m, base):
            yield name, m


@contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]):
    """Run ``chunks`` (bare or DDP-wrapped) as the base model: every adapter is switched off
    inside the block and back on after it."""
    wrappers: List[torch.nn.Module] = []
    for c in chunks:
        wrappers += [w for _, w in adapter_wrappers(getattr(c, "module", c))]
    for w in wrappers:
        w.disable_adapter_layers()
    try:
        yield
    finally:
        for w in wrappers:
            w.enable_adapter_layers()

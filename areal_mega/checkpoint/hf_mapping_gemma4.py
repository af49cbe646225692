"""Gemma 4's per-layer tensor rows (:mod:`areal_mega.models.gemma4`).

The bridge's registry gives one QKV row for every layer (``_Gemma4DenseQKVMapping``, which
tolerates the absent projections); the checkpoint's layers differ by type:

* sliding layers: ``q_proj``, ``k_proj``, ``v_proj`` at ``head_dim`` (kind ``qkv``);
* full layers: at ``global_head_dim`` (kind ``qkv_full``), without ``v_proj`` when
  ``attention_k_eq_v`` (kind ``qk_full``: megatron's ``linear_qkv`` holds per KV group the
  group's query heads, then its key);
* key/value-shared layers (the last ``num_kv_shared_layers``): ``q_proj`` alone, which is the
  whole ``linear_qkv`` (kind ``copy``), and no ``k_norm``.

With ``enable_moe_block`` every layer's MLP rows become those of
:class:`~areal_mega.models.gemma4.Gemma4MoELayer` (:data:`MOE_ROWS`): the dense MLP as the
shared expert, the router's gate, scale and per-expert scale, each expert's slice of the
checkpoint's ``experts.gate_up_proj`` / ``experts.down_proj`` (``[experts, out, in]``, kind
``fused_expert_rows``) and the four branch norms, which replace the layer's
``pre_mlp_layernorm``.

:func:`layer_rows` rewrites a layer's table rows accordingly; :func:`full_shapes` gives the
full (un-split) megatron shapes of the tensor-parallel tensors of a layer (and the per-layer
input tensors) for the live export's gathers.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "GEMMA4_KINDS",
    "MOE_ROWS",
    "attention_rows",
    "layer_rows",
    "global_rows",
    "full_shapes",
    "to_mcore",
    "to_hf",
    "to_hf_segments",
    "to_mcore_segments",
]

GEMMA4_KINDS = ("qkv_full", "qk_full")
_QKV = "self_attention.linear_qkv.weight"
_HF = "model.layers.{L}."
#: a layer's MLP rows with the MoE block: (megatron suffix, HF names, kind)
MOE_ROWS = (
    ("mlp.shared_experts.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    ("mlp.shared_experts.linear_fc2.weight", ("mlp.down_proj.weight",), "copy"),
    ("mlp.router.weight", ("router.proj.weight",), "copy"),
    ("mlp.router.scale", ("router.scale",), "copy"),
    ("mlp.router.per_expert_scale", ("router.per_expert_scale",), "copy"),
    (
        "mlp.experts.local_experts.{E}.linear_fc1.weight",
        ("experts.gate_up_proj[{E}]",),
        "fused_expert_rows",
    ),
    (
        "mlp.experts.local_experts.{E}.linear_fc2.weight",
        ("experts.down_proj[{E}]",),
        "fused_expert_rows",
    ),
    ("mlp.pre_shared_expert_layernorm.weight", ("pre_feedforward_layernorm.weight",), "copy"),
    ("mlp.pre_moe_layernorm.weight", ("pre_feedforward_layernorm_2.weight",), "copy"),
    ("mlp.post_shared_expert_layernorm.weight", ("post_feedforward_layernorm_1.weight",), "copy"),
    ("mlp.post_moe_layernorm.weight", ("post_feedforward_layernorm_2.weight",), "copy"),
)
#: the dense layer's rows that the MoE block's replace
_DENSE_MLP_ROWS = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


def attention_rows(arch, layer: int) -> tuple:
    """``(kind, heads, kv heads, head dim)`` of layer ``layer``'s fused ``linear_qkv``: kind
    ``qkv`` (per KV group its query heads, key, value), ``qk`` (K = V layers: no value rows)
    or ``q`` (key/value-shared layers: the query heads alone)."""
    full = arch.layer_types[layer] == "full_attention"
    hd = arch.global_head_dim if full else arch.head_dim
    k_eq_v = full and arch.attention_k_eq_v
    kv = arch.global_kv_heads if k_eq_v else arch.num_kv_heads
    if layer >= arch.num_layers - arch.num_kv_shared_layers:
        return "q", arch.num_heads, kv, hd
    return ("qk" if k_eq_v else "qkv"), arch.num_heads, kv, hd


def _per_layer_input_row(arch, m) -> bool:
    """Whether ``m`` is a per-layer-input tensor of a model without per-layer inputs."""
    return not arch.per_layer_input_size and (
        m.mcore.startswith("per_layer_") or m.mcore.startswith("post_per_layer_")
    )


def global_rows(arch, rows: Sequence) -> tuple:
    """The non-layer rows, without the per-layer-input tensors when the model has none."""
    return tuple(m for m in rows if not _per_layer_input_row(arch, m))


def layer_rows(arch, layer: int, rows: Sequence) -> tuple:
    """Layer ``layer``'s table rows (``TensorMap``) with its QKV kind and HF names, without
    ``k_norm`` on key/value-shared layers and without the per-layer-input tensors when the
    model has none; with the MoE block, its rows (:data:`MOE_ROWS`) in place of the dense
    MLP's."""
    kind = attention_rows(arch, layer)[0]
    full = arch.layer_types[layer] == "full_attention"
    out = []
    for m in rows:
        if (
            (m.mcore == "self_attention.k_layernorm.weight" and kind == "q")
            or _per_layer_input_row(arch, m)
            or (arch.is_moe and m.mcore in _DENSE_MLP_ROWS)
        ):
            continue
        if m.mcore == _QKV:
            if kind == "q":
                m = type(m)(m.mcore, m.hf[:1], "copy")
            elif kind == "qk":
                m = type(m)(m.mcore, m.hf[:2], "qk_full")
            elif full:
                m = type(m)(m.mcore, m.hf, "qkv_full")
        out.append(m)
    if arch.is_moe:
        row = type(rows[0])
        out += [row(mcore, tuple(_HF + h for h in hf), k) for mcore, hf, k in MOE_ROWS]
    return tuple(out)


def _blocks(arch, kind: str) -> List[List[Tuple[int, int]]]:
    """Per HF tensor (q, k[, v]) the megatron row ranges (one per KV group) of a full layer."""
    k_eq_v = kind == "qk_full"
    groups = arch.global_kv_heads if k_eq_v else arch.num_kv_heads
    hd = arch.global_head_dim
    q = arch.num_heads // groups * hd
    g = q + (1 if k_eq_v else 2) * hd
    out = [
        [(i * g, i * g + q) for i in range(groups)],
        [(i * g + q, i * g + q + hd) for i in range(groups)],
    ]
    if not k_eq_v:
        out.append([(i * g + q + hd, (i + 1) * g) for i in range(groups)])
    return out


def full_shapes(arch, layer: Optional[int]) -> dict:
    """The full megatron shapes of layer ``layer``'s tensor-parallel tensors (None: the
    non-layer per-layer-input tensors)."""
    h = arch.hidden_size
    if layer is None:
        n = arch.num_layers * arch.per_layer_input_size
        return {
            "per_layer_embedding.weight": (arch.per_layer_vocab_size, n),
            "per_layer_model_proj.weight": (n, h),
        }
    kind, heads, kv, hd = attention_rows(arch, layer)
    rows = heads * hd + {"q": 0, "qk": 1, "qkv": 2}[kind] * kv * hd
    ffn = arch.ffn_hidden_size
    if arch.double_wide_mlp and kind == "q":
        ffn *= 2
    return {
        _QKV: (rows, h),
        "self_attention.linear_proj.weight": (h, heads * hd),
        "mlp.linear_fc1.weight": (2 * ffn, h),
        "mlp.linear_fc2.weight": (h, ffn),
    }


def to_hf_segments(arch, kind: str, t: torch.Tensor) -> Tuple[List[torch.Tensor], ...]:
    """Each HF tensor as row-block views of the megatron tensor ``t``."""
    return tuple([t[a:b] for a, b in blocks] for blocks in _blocks(arch, kind))


def to_hf(arch, kind: str, t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The megatron tensor -> HF tensors (q, k[, v])."""
    return tuple(torch.cat(segs).contiguous() for segs in to_hf_segments(arch, kind, t))


def to_mcore_segments(
    arch, kind: str, hf_names: Sequence[str], get: Callable[[str], torch.Tensor]
) -> Iterator[torch.Tensor]:
    """Row blocks whose concatenation is the megatron tensor (group by group)."""
    hf = [get(n) for n in hf_names]
    blocks = _blocks(arch, kind)
    for g in range(len(blocks[0])):
        for j, x in enumerate(hf):
            a, b = blocks[j][g]
            n = b - a
            yield x[g * n : (g + 1) * n]


def to_mcore(arch, kind: str, hf_tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """HF tensors (q, k[, v]) -> the megatron tensor."""
    names = [str(i) for i in range(len(hf_tensors))]
    return torch.cat(list(to_mcore_segments(arch, kind, names, lambda n: hf_tensors[int(n)])))

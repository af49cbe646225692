"""Live export: this rank's megatron model chunks → HF-named full tensors, streamed in buckets.

For the weight sender (rollout weight updates) and for writing HF directories from a running
trainer. Per parameter, in model order:

* TP shards are all-gathered over the tensor-parallel group (the expert-tensor-parallel group
  for expert weights) and un-split along the axis :func:`gather_axis` derives from the shard's
  shape and the full megatron shape the HF config implies (:func:`expected_full_shape`), not
  from the ``partition_dim`` attribute: TE's ``GroupedLinear`` built with megatron's explicit
  expert communication marks the row-parallel ``linear_fc2`` with ``partition_dim=0`` although
  it is split on dim 1. GLU ``linear_fc1`` shards are ``[gate_r; up_r]`` so gates and ups are
  gathered separately, as are the sections megatron marks with ``partition_sizes`` (the Mamba
  mixer's in_proj and convolution);
* expert weights are all-gathered over the expert-parallel group (local expert ``e`` of EP rank
  ``r`` is global expert ``r·E/EP + e``);
* pipeline stages export only their own layers, under *global* layer indices (the layer's
  ``layer_number``), so the union over stages is the whole model; with tied embeddings the last
  stage's copy of the embedding is skipped.

Then :mod:`~areal_mega.checkpoint.hf_mapping` turns each full megatron tensor into HF tensors.
Only one parameter's gathered tensors (plus the current bucket) are alive at a time. Every rank
of a TP/EP group must iterate together (the gathers are collectives); every such rank gets the
full tensors, and the caller decides which ranks send (typically TP rank 0 / DP rank 0 of each
pipeline stage; see :func:`is_export_source`).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from areal_mega.checkpoint import hf_mapping as hm
from areal_mega.checkpoint import hf_mapping_gdn, hf_mapping_gemma4
from areal_mega.checkpoint.bridge_tables import FUSED_EXPERT_KINDS
from areal_mega.checkpoint.safetensors_io import split_row_name
from areal_mega.models.falcon_h1 import falcon_h1_full_shapes
from areal_mega.models.mla import mla_full_shapes
from areal_mega.models.nemotron_h import nemotron_h_full_shapes

__all__ = [
    "iter_hf_tensors",
    "iter_hf_buckets",
    "is_export_source",
    "gather_axis",
    "expected_full_shape",
]

Shape = Tuple[Optional[int], ...]


def expected_full_shape(arch, suffix: str, layer: Optional[int] = None) -> Optional[Shape]:
    """The full (un-split) megatron shape of a tensor-parallel parameter, from the HF config.

    ``suffix``: the canonical name from :func:`hf_mapping.parse_mcore_name`. ``None`` entries
    are sizes the config does not fix (the padded vocabulary rows); an unknown name gives
    ``None`` (no expectation: only a 1-D shard then has a unique gather axis). ``layer``: the
    global layer index, for families whose layers differ in shape (Gemma 4)."""
    h, hd = arch.hidden_size, arch.head_dim
    gate_rows = arch.num_heads * hd if arch.attention_output_gate else 0
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * hd + gate_rows
    moe_ffn = arch.moe_ffn_hidden_size
    shapes = {
        "embedding.word_embeddings.weight": (None, h),
        "output_layer.weight": (None, h),
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.linear_proj.weight": (h, arch.num_heads * hd),
        "mlp.linear_fc1.weight": ((2 if arch.gated_mlp else 1) * arch.ffn_hidden_size, h),
        "mlp.linear_fc2.weight": (h, arch.ffn_hidden_size),
    }
    if moe_ffn:
        shapes["mlp.experts.local_experts.{E}.linear_fc1.weight"] = (2 * moe_ffn, h)
        shapes["mlp.experts.local_experts.{E}.linear_fc2.weight"] = (h, moe_ffn)
    if arch.is_mla:
        shapes.update(mla_full_shapes(arch))
    if arch.gdn_heads is not None:
        nk, nv, dk, dv = arch.gdn_heads
        shapes["self_attention.in_proj.weight"] = (2 * nk * dk + 2 * nv * dv + 2 * nv, h)
        shapes["self_attention.conv1d.weight"] = (2 * nk * dk + nv * dv, 1, None)
        shapes["self_attention.A_log"] = shapes["self_attention.dt_bias"] = (nv,)
        shapes["self_attention.out_proj.weight"] = (h, nv * dv)
    if arch.hybrid_layer_pattern is not None:
        shapes.update(nemotron_h_full_shapes(arch.source_config(), h))
    if arch.mamba_beside_attention:
        shapes.update(falcon_h1_full_shapes(arch.source_config(), h))
    shared = arch.moe_shared_ffn_hidden_size
    if shared:
        shapes["mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
        shapes["mlp.shared_experts.linear_fc2.weight"] = (h, shared)
    if arch.model_type == "gemma4_text":
        shapes.update(hf_mapping_gemma4.full_shapes(arch, layer))
    return shapes.get(suffix)


def gather_axis(
    name: str, local_shape: Sequence[int], full_shape: Optional[Sequence], tp_size: int
) -> Optional[int]:
    """The axis along which ``tp_size`` shards of ``local_shape`` concatenate to ``full_shape``.

    A pure function of shapes: axis ``d`` fits when ``local[d] * tp_size`` equals ``full[d]``
    and every other dimension is equal (``None`` in ``full_shape`` matches any size;
    ``full_shape=None`` means nothing is known). Returns ``None`` for ``tp_size == 1`` (nothing
    to gather, after checking the shapes agree). Raises ``ValueError`` naming the parameter
    when no axis fits or more than one does."""
    local = tuple(int(x) for x in local_shape)
    full = tuple(full_shape) if full_shape is not None else (None,) * len(local)
    if tp_size < 1:
        raise ValueError(f"{name}: tensor-parallel size must be >= 1, got {tp_size}")
    if len(local) != len(full):
        raise ValueError(
            f"{name}: local shard shape {local} has {len(local)} dims but the "
            f"full shape the HF config implies is {full}"
        )

    def fits(size, want):
        return want is None or size == want

    if tp_size == 1:
        if not all(fits(a, b) for a, b in zip(local, full)):
            raise ValueError(
                f"{name}: shape {local} does not match the HF config's {full} "
                "(tensor-parallel size 1)"
            )
        return None
    axes = [
        d
        for d in range(len(local))
        if fits(local[d] * tp_size, full[d])
        and all(fits(local[k], full[k]) for k in range(len(local)) if k != d)
    ]
    if len(axes) == 1:
        return axes[0]
    what = "no axis fits" if not axes else f"ambiguous: axes {axes} all fit"
    raise ValueError(
        f"{name}: cannot tell which axis its {tp_size} tensor-parallel shards "
        f"split ({what}): local shard shape {local}, full shape {full} (None = "
        "not fixed by the HF config)"
    )


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather_glu(t: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    halves = [torch.chunk(p, 2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def _gather_sections(t: torch.Tensor, group, sizes: Sequence[int]) -> torch.Tensor:
    """Shards whose rows are sections each split across the ranks, each rank holding its slice
    of every section in order (``sizes``: one rank's rows per section; megatron's
    ``partition_sizes`` of the Mamba mixer's in_proj [z; x; B; C; dt] and convolution [x; B; C],
    the gated delta-net's input projection and convolution): gathered section by section."""
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    split = [torch.split(x, list(sizes), dim=0) for x in parts]
    return torch.cat([sec[i] for i in range(len(sizes)) for sec in split], dim=0)


def _layer_offsets(chunk) -> List[int]:
    """Global index of each of this chunk's layers (from megatron's 1-based layer_number)."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    return [int(layer.layer_number) - 1 for layer in layers] if layers is not None else []


def _unwrap(m):
    while not hasattr(m, "decoder") and hasattr(m, "module"):
        m = m.module
    return m


def _exported_tensors(chunk):
    """The chunk's parameters, then its routers' expert biases (buffers that HF checkpoints
    hold: ``e_score_correction_bias``; replicated, never tensor-parallel). LoRA adapters are
    left out (PEFT files, :mod:`areal_mega.lora.peft_io`) and a wrapped base linear keeps its
    own name (``linear_qkv.to_wrap.weight`` is ``linear_qkv.weight``)."""
    for name, p in chunk.named_parameters():
        if ".adapter." not in name:
            yield name.replace(".to_wrap.", "."), p
    for name, buf in chunk.named_buffers():
        if name.endswith(("router.expert_bias", ".layer_scalar")):
            yield name, buf


def is_export_source() -> bool:
    """True on the ranks that should send the exported tensors: TP rank 0 and DP rank 0 (with
    context parallelism, CP rank 0) of each pipeline stage."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def iter_hf_tensors(
    model: Sequence[torch.nn.Module],
    arch,
    *,
    tp_group=None,
    ep_group=None,
    etp_group=None,
    dtype: Optional[torch.dtype] = None,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for this pipeline stage's share of the model (a fused
    expert tensor, GPT-OSS's, once its layer's experts are all gathered).

    ``model``: this rank's chunks; ``arch``: :func:`hf_mapping.read_arch` of the model's HF
    config. Groups default to megatron's parallel state. ``dtype``: cast before yielding.
    Without a cast, an ungathered tensor (TP 1, replicated norms) may be a view of the live
    parameter: send or clone it before the next optimizer step."""
    from megatron.core import parallel_state as ps

    tp_group = tp_group or ps.get_tensor_model_parallel_group()
    ep_group = ep_group or (ps.get_expert_model_parallel_group() if arch.is_moe else None)
    etp_group = etp_group or (ps.get_expert_tensor_parallel_group() if arch.is_moe else None)
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    fused: Dict[str, Dict[int, torch.Tensor]] = {}  # fused expert tensor -> experts so far
    for chunk in model:
        chunk = _unwrap(chunk)
        offsets = _layer_offsets(chunk)
        tied_copy = arch.tie_word_embeddings and not getattr(chunk, "pre_process", True)
        for name, p in _exported_tensors(chunk):
            layer, expert, suffix = hm.parse_mcore_name(name)
            if (
                layer is None
                and suffix == "output_layer.weight"
                and (arch.tie_word_embeddings or tied_copy)
            ):
                continue  # HF ties lm_head to the embedding
            is_expert = expert is not None
            tgroup = etp_group if is_expert else tp_group
            t = p.detach()
            glayer = offsets[layer] if layer is not None else None
            if getattr(p, "tensor_model_parallel", False):
                tp_size = dist.get_world_size(tgroup) if tgroup is not None else 1
                full_shape = expected_full_shape(arch, suffix, glayer)
                axis = gather_axis(name, t.shape, full_shape, tp_size)
                # a gated MLP's fc1 shards are [gate_r; up_r] (Nemotron's squared-ReLU MLP
                # has no gate: its fc1 shards concatenate as they are)
                glu = arch.gated_mlp and suffix.endswith(("linear_fc1.weight", "linear_fc1.bias"))
                if glu and axis not in (None, 0):
                    raise ValueError(
                        f"{name}: GLU linear_fc1 shards must split dim 0 "
                        f"([gate_r; up_r]), the shapes say dim {axis}"
                    )
                # sectioned shards: megatron's per-rank partition_sizes (Mamba), or the gated
                # delta-net's sections (full sizes, split evenly)
                sections = getattr(p, "partition_sizes", None)
                full_sections = hf_mapping_gdn.tp_sections(arch, suffix)
                if sections is None and full_sections is not None:
                    n_tp = dist.get_world_size(tgroup) if tgroup is not None else 1
                    sections = [s // n_tp for s in full_sections]
                if sections is not None and axis not in (None, 0):
                    raise ValueError(f"{name}: sectioned shards must split dim 0, not {axis}")
                if axis is not None and sections is not None:
                    t = _gather_sections(t, tgroup, sections)
                elif axis is not None:
                    t = _gather_glu(t, tgroup) if glu else _gather(t, tgroup, axis)
            if is_expert and ep_size > 1:
                parts = [torch.empty_like(t) for _ in range(ep_size)]
                dist.all_gather(parts, t.contiguous(), group=ep_group)
                n_local = arch.num_experts // ep_size
                items = [(r * n_local + expert, x) for r, x in enumerate(parts)]
            else:
                items = [(expert, t)]
            for e, full in items:
                hf_names, kind = hm.hf_names_for(arch, glayer, e, suffix)
                for hn, ht in zip(hf_names, hm.to_hf(arch, kind, full)):
                    ht = ht.to(dtype) if dtype is not None else ht
                    if kind in FUSED_EXPERT_KINDS:  # yielded whole with the layer's last expert
                        base, row = split_row_name(hn)
                        fused.setdefault(base, {})[row] = ht
                        if len(fused[base]) < arch.num_experts:
                            continue
                        rows = fused.pop(base)
                        hn, ht = base, torch.stack([rows[i] for i in range(arch.num_experts)])
                    yield hn, ht
            del t, items


def iter_hf_buckets(
    model: Sequence[torch.nn.Module], arch, *, bucket_bytes: int = 512 << 20, **kw
) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Group :func:`iter_hf_tensors` into lists of at most ``bucket_bytes`` (a tensor larger
    than that is a bucket of its own)."""
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in iter_hf_tensors(model, arch, **kw):
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket

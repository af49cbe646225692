"""An HF vision-language checkpoint's tensors into the model that
:mod:`areal_mega.models.vlm.builder` built (and back), through the bridge's table
(``bridge_tables.json``'s ``vl_families``, from Megatron-Bridge's registry:
:func:`areal_mega.checkpoint.bridge_tables.vl_table_from_rows`).

The language model's tensors take the text families' transforms
(:mod:`areal_mega.checkpoint.hf_mapping`: fused QKV per KV group, ``[gate; up]``, padded
vocabulary); a whole-module subtree (the vision tower and projector, transformers' own modules
in the bridge's model) is copied name for name; a tower of megatron-core layers (Qwen3-VL's)
goes tensor by tensor through the table's ``"vision"`` patterns, its attention's ``[q; k; v]``
regrouped per head as megatron fuses it. Every parameter of the model must be found in
the checkpoint and every checkpoint tensor must be used (a tied model has no ``lm_head``).
Loading copies the full tensors, so the model must not be tensor-parallel there (a TP or PP
trainer loads the converted megatron checkpoint, resharded); the export
(:func:`iter_vl_hf_tensors`) gathers each tensor-parallel parameter from its TP shards and
gives a pipeline stage's layers their global indices, at any TP / PP layout.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from areal_mega.checkpoint.bridge_tables import VL_LANGUAGE_PREFIX, load_tables
from areal_mega.checkpoint.hf_mapping import (
    UnsupportedModelError,
    glu_to_hf,
    glu_to_mcore,
    pad_vocab,
    qkv_to_hf,
    qkv_to_mcore,
    unpad_vocab,
)

__all__ = [
    "vl_table",
    "hf_sources",
    "load_hf_weights",
    "to_hf_state_dict",
    "iter_vl_hf_tensors",
]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def vl_table(model_type: str) -> dict:
    """The stored table of a vision-language ``model_type``: ``{"language": {"global",
    "layer"}, "subtrees"}``."""
    fams = load_tables().get("vl_families", {})
    if model_type not in fams:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no vision-language table; known: {sorted(fams)}"
        )
    return fams[model_type]


def _vision_regex(pattern: str) -> "re.Pattern":
    """A vision row's megatron pattern as a regex: ``*`` an index, ``**`` the rest."""
    parts = re.split(r"(\*\*|\*)", pattern)
    return re.compile(
        "^"
        + "".join("(.+)" if p == "**" else r"(\d+)" if p == "*" else re.escape(p) for p in parts)
        + "$"
    )


def _vision_source(table: dict, name: str) -> Optional[Tuple[List[str], str]]:
    """The HF name and kind of a vision-tower parameter by the table's ``"vision"`` patterns
    (the wildcards' values filled into the HF pattern in order), or None."""
    for row in table.get("vision", ()):
        m = _vision_regex(row["mcore"]).match(name)
        if m is None:
            continue
        pieces = re.split(r"\*\*|\*", row["hf"][0])
        hf = pieces[0] + "".join(v + p for v, p in zip(m.groups(), pieces[1:]))
        return [hf], row["kind"]
    return None


def _vision_config(model):
    c = model.vision_model.config
    return c.num_attention_heads, c.kv_channels


def hf_sources(table: dict, name: str) -> Tuple[List[str], str]:
    """The HF names and transform kind of one megatron parameter ``name`` of the model."""
    vision = _vision_source(table, name)
    if vision is not None:
        return vision
    for sub in table["subtrees"]:
        if name.startswith(sub["mcore"]):
            return [sub["hf"] + name[len(sub["mcore"]) :]], "copy"
    if not name.startswith(VL_LANGUAGE_PREFIX):
        raise UnsupportedModelError(f"{name}: neither the language model's nor a subtree's")
    rest = name[len(VL_LANGUAGE_PREFIX) :]
    m = _LAYER.match(rest)
    layer, suffix = (int(m.group(1)), m.group(2)) if m else (None, rest)
    for row in table["language"]["layer" if m else "global"]:
        if row["mcore"] == suffix:
            return [h.format(L=layer) for h in row["hf"]], row["kind"]
    raise UnsupportedModelError(f"{name}: no HF mapping in the bridge's table")


def _language_config(model):
    c = model.language_model.config
    return c.num_attention_heads, c.num_query_groups, c.kv_channels


def _single_rank(model) -> None:
    if model.language_model.config.tensor_model_parallel_size != 1:
        raise NotImplementedError(
            "vision-language weights load and save at TP=1 only (the full tensors are copied)"
        )


def load_hf_weights(model, weights, *, table: Optional[dict] = None, model_type="qwen2_5_vl"):
    """Copy an HF checkpoint (``weights``: a :class:`~areal_mega.checkpoint.safetensors_io.
    SafetensorsDir` or a name -> tensor dict) into ``model`` (a rank's whole
    ``Qwen25VLModel``); returns the HF names used."""
    _single_rank(model)
    table = table or vl_table(model_type)
    heads, groups, head_dim = _language_config(model)
    get = weights.get if hasattr(weights, "get") else weights.__getitem__
    names = set(weights.keys())
    used = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            hf, kind = hf_sources(table, name)
            missing = [h for h in hf if h not in names]
            if missing:
                raise UnsupportedModelError(f"{name}: the checkpoint has no {missing}")
            ts = [get(h) for h in hf]
            used.update(hf)
            if kind == "copy":
                t = ts[0]
            elif kind == "qkv":
                t = qkv_to_mcore(*ts, heads, groups, head_dim)
            elif kind == "glu":
                t = glu_to_mcore(*ts)
            elif kind == "vocab":
                t = pad_vocab(ts[0], param.shape[0])
            elif kind == "qkv_concat":  # [q; k; v] in one tensor, the tower's heads
                v_heads, v_dim = _vision_config(model)
                t = qkv_to_mcore(*ts[0].chunk(3, dim=0), v_heads, v_heads, v_dim)
            else:
                raise UnsupportedModelError(f"{name}: transform {kind!r} is not supported here")
            if tuple(t.shape) != tuple(param.shape):
                raise UnsupportedModelError(
                    f"{name}: shape {tuple(param.shape)}, the checkpoint's {tuple(t.shape)}"
                )
            param.copy_(t)
    unused = names - used
    if unused:
        raise UnsupportedModelError(
            f"checkpoint tensors the model has no place for: {sorted(unused)}"
        )
    return used


def _to_hf(model, kind: str, name: str, t: torch.Tensor, vocab_size: int) -> tuple:
    """One full megatron tensor of ``model`` as its HF tensors (the table's ``kind``)."""
    if kind == "copy":
        return (t,)
    if kind == "qkv":
        heads, groups, head_dim = _language_config(model)
        return qkv_to_hf(t, heads, groups, head_dim)
    if kind == "glu":
        return glu_to_hf(t)
    if kind == "vocab":
        return (unpad_vocab(t, vocab_size),)
    if kind == "qkv_concat":
        v_heads, v_dim = _vision_config(model)
        return (torch.cat(qkv_to_hf(t, v_heads, v_heads, v_dim)),)
    raise UnsupportedModelError(f"{name}: transform {kind!r} is not supported here")


def to_hf_state_dict(
    model, vocab_size: int, *, table: Optional[dict] = None, model_type="qwen2_5_vl"
) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`load_hf_weights`: the model's parameters as HF tensors."""
    _single_rank(model)
    table = table or vl_table(model_type)
    out: Dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        hf, kind = hf_sources(table, name)
        for h, x in zip(hf, _to_hf(model, kind, name, param.detach(), vocab_size)):
            out[h] = x.contiguous().clone()
    return out


def _global_layer_name(model, name: str) -> str:
    """``name`` with a language-model layer's stage-local index replaced by its global one
    (megatron's 1-based ``layer_number``): a later pipeline stage's layers start at 0."""
    if not name.startswith(VL_LANGUAGE_PREFIX):
        return name
    m = _LAYER.match(name[len(VL_LANGUAGE_PREFIX) :])
    if m is None:
        return name
    layer = model.language_model.decoder.layers[int(m.group(1))]
    return f"{VL_LANGUAGE_PREFIX}decoder.layers.{int(layer.layer_number) - 1}.{m.group(2)}"


def iter_vl_hf_tensors(
    model,
    vocab_size: int,
    *,
    table: Optional[dict] = None,
    model_type: str = "qwen2_5_vl",
    tp_group=None,
    dtype: Optional[torch.dtype] = None,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for this pipeline stage's share of a vision-language
    ``model`` (one rank's chunk: the vision tower and projector on the first stage only).

    A tensor-parallel parameter is all-gathered over ``tp_group`` (default: megatron's) along
    its ``partition_dim`` (a GLU ``linear_fc1``'s ``[gate_r; up_r]`` shards gate by gate and up
    by up, :mod:`~areal_mega.checkpoint.export`'s gathers), so every rank of a TP group must
    iterate together and each gets the full tensors; layers take their global indices; a
    later stage's copy of tied embeddings is skipped. The union over the stages is
    :func:`to_hf_state_dict` of the one-rank model."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from areal_mega.checkpoint.export import _gather, _gather_glu

    table = table or vl_table(model_type)
    if tp_group is None and dist.is_initialized():
        tp_group = ps.get_tensor_model_parallel_group()
    lm = model.language_model
    tied_copy = bool(getattr(lm, "share_embeddings_and_output_weights", False)) and not getattr(
        lm, "pre_process", True
    )
    for name, param in model.named_parameters():
        if tied_copy and name == f"{VL_LANGUAGE_PREFIX}output_layer.weight":
            continue  # HF ties lm_head to the embedding (the first stage's)
        hf, kind = hf_sources(table, _global_layer_name(model, name))
        t = param.detach()
        if getattr(param, "tensor_model_parallel", False):
            if kind == "glu":
                t = _gather_glu(t, tp_group)
            else:
                t = _gather(t, tp_group, int(param.partition_dim))
        for h, x in zip(hf, _to_hf(model, kind, name, t, vocab_size)):
            yield h, (x if dtype is None else x.to(dtype))
        del t

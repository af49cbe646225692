"""The one place where Hugging Face names/layouts meet megatron-core ``GPTModel`` names/layouts.

Used by the offline converters (``tools/convert_*.py``), the live weight export to rollout
servers (:mod:`areal_mega.checkpoint.export`) and the checkpoint tests. Everything here is pure
tensor/str manipulation: no process groups, no model files.

The name tables are Megatron-Bridge's: each family's rows are read from the bridge's mapping
registry for its HF architecture (:mod:`areal_mega.checkpoint.bridge_tables`, stored in
``bridge_tables.json`` and checked against the installed bridge by a test); this module only
streams and reshards by them. They amount to:

Megatron names are the module parameter names of one model chunk built by
:func:`areal_mega.models.builder.build_model_chunks` (local spec), with the layer index and the
expert index *global* (the caller adds the PP/VPP layer offset and the EP expert offset):

======================================================  ========================================
megatron (local spec; TE alias)                          HF (Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE)
======================================================  ========================================
``embedding.word_embeddings.weight`` [V_pad, H]          ``model.embed_tokens.weight`` [V, H]
``decoder.layers.L.input_layernorm.weight``              ``model.layers.L.input_layernorm.weight``
  (TE: ``self_attention.linear_qkv.layer_norm_weight``)
``decoder.layers.L.self_attention.linear_qkv.weight``    ``self_attn.{q,k,v}_proj.weight``
  rows grouped per KV group g: [q heads of g; k_g; v_g]
``...linear_qkv.bias`` (Qwen2)                           ``self_attn.{q,k,v}_proj.bias``
``...self_attention.q_layernorm.weight`` (Qwen3)         ``self_attn.q_norm.weight``
``...self_attention.k_layernorm.weight`` (Qwen3)         ``self_attn.k_norm.weight``
``...self_attention.linear_proj.weight``                 ``self_attn.o_proj.weight``
``decoder.layers.L.pre_mlp_layernorm.weight``            ``post_attention_layernorm.weight``
  (TE: ``mlp.linear_fc1.layer_norm_weight``)
``...mlp.linear_fc1.weight`` = [gate; up]                ``mlp.{gate,up}_proj.weight``
``...mlp.linear_fc2.weight``                             ``mlp.down_proj.weight``
``...mlp.router.weight`` (MoE)                           ``mlp.gate.weight``
``...mlp.experts.local_experts.E.linear_fc1.weight``     ``mlp.experts.E.{gate,up}_proj.weight``
  (TE grouped GEMM: ``mlp.experts.linear_fc1.weightE``)
``...mlp.experts.local_experts.E.linear_fc2.weight``     ``mlp.experts.E.down_proj.weight``
``decoder.final_layernorm.weight``                       ``model.norm.weight``
``output_layer.weight`` [V_pad, H] (untied only)         ``lm_head.weight`` [V, H]
======================================================  ========================================

Gemma 3 (tied embeddings) differs in three rows: ``pre_mlp_layernorm.weight`` is HF's
``pre_feedforward_layernorm.weight``, and its post-norms are
``self_attention.linear_proj.post_layernorm.weight`` (``post_attention_layernorm.weight``) and
``mlp.linear_fc2.post_layernorm.weight`` (``post_feedforward_layernorm.weight``), the
bridge's names and ours (:mod:`areal_mega.models.gemma3`).

The vocabulary rows are padded with zeros to ``padded_vocab_size`` going to megatron and cut
back to ``vocab_size`` going to HF. Legacy ``GroupedMLP`` (``weight1``/``weight2``) is not
produced by the builder and is refused by name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from areal_mega.checkpoint import hf_mapping_gdn, hf_mapping_gemma4
from areal_mega.checkpoint.bridge_tables import FUSED_EXPERT_KINDS, load_tables
from areal_mega.checkpoint.hf_mapping_gdn import GDN_KINDS
from areal_mega.checkpoint.hf_mapping_gemma4 import GEMMA4_KINDS
from areal_mega.checkpoint.hf_mapping_moe import optional_map_present
from areal_mega.checkpoint.safetensors_io import split_row_name
from areal_mega.checkpoint.value_model import value_model_problem
from areal_mega.models.bridge_provider import HYBRID_FAMILIES, gpu_only_reason, not_built_reason
from areal_mega.models.builder import normalize_hf_config  # noqa: F401 (re-exported)

__all__ = [
    "UnsupportedModelError",
    "TensorMap",
    "Family",
    "FAMILIES",
    "read_arch",
    "normalize_hf_config",
    "parse_mcore_name",
    "canonical_layer_suffix",
    "maps_for",
    "to_mcore",
    "to_hf",
    "hf_names_for",
    "qkv_to_mcore",
    "qkv_to_hf",
    "glu_to_mcore",
    "glu_to_hf",
    "expert_to_mcore",
    "expert_to_hf",
    "pad_vocab",
    "unpad_vocab",
    "hf_tensor_names",
    "qkv_row_blocks",
    "to_hf_segments",
    "to_mcore_segments",
]


class UnsupportedModelError(ValueError):
    """An HF config (or tensor set) this mapping does not support; the message names the file."""


# ----------------------------------------------------------------------------------------------
# tensor layout transforms (full, unsharded tensors)
# ----------------------------------------------------------------------------------------------


def qkv_to_mcore(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """HF q/k/v projections (weights [n·d, H] or biases [n·d]) → megatron fused QKV, rows
    grouped per KV group: [q heads of group g (n_q/n_kv of them); k_g; v_g] for g = 0..n_kv-1."""
    r = num_heads // num_kv_heads
    rest = tuple(q.shape[1:])
    parts = [
        q.reshape(num_kv_heads, r * head_dim, *rest),
        k.reshape(num_kv_heads, head_dim, *rest),
        v.reshape(num_kv_heads, head_dim, *rest),
    ]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def qkv_to_hf(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_to_mcore`."""
    r = num_heads // num_kv_heads
    rest = tuple(qkv.shape[1:])
    g = qkv.reshape(num_kv_heads, (r + 2) * head_dim, *rest)
    q, k, v = torch.split(g, [r * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def glu_to_mcore(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate/up projections → megatron ``linear_fc1`` = [gate; up] (full, unsharded)."""
    return torch.cat([gate, up], dim=0)


def glu_to_hf(fc1: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`glu_to_mcore`."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def expert_to_mcore(kind: str, t: torch.Tensor) -> torch.Tensor:
    """One expert's slice of a fused HF expert tensor → its megatron tensor. GPT-OSS
    (``fused_expert`` / ``fused_expert_glu``): weights transposed (HF stores ``x @ W``, [in,
    out]); ``fused_expert_glu``'s gate / up units interleaved in HF (gate on even, up on odd)
    → megatron's [gate; up]. Gemma 4 (``fused_expert_rows``): the slice as it is ([out, in],
    gate then up)."""
    if kind == "fused_expert_rows":
        return t.contiguous()
    if t.dim() == 2:
        t = t.t()
    if kind == "fused_expert_glu":
        t = torch.cat([t[0::2], t[1::2]], dim=0)
    return t.contiguous()


def expert_to_hf(kind: str, t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`expert_to_mcore`."""
    if kind == "fused_expert_rows":
        return t.contiguous()
    if kind == "fused_expert_glu":
        gate, up = torch.chunk(t, 2, dim=0)
        t = torch.stack([gate, up], dim=1).reshape(t.shape)
    if t.dim() == 2:
        t = t.t()
    return t.contiguous()


def pad_vocab(t: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows up to ``padded_vocab_size`` (embedding / output layer)."""
    if t.shape[0] > padded_vocab_size:
        raise ValueError(f"vocabulary of {t.shape[0]} rows exceeds padded size {padded_vocab_size}")
    if t.shape[0] == padded_vocab_size:
        return t
    pad = t.new_zeros((padded_vocab_size - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def unpad_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Cut the padded rows off (embedding / output layer)."""
    return t[:vocab_size].contiguous() if t.shape[0] != vocab_size else t


# ----------------------------------------------------------------------------------------------
# the per-family tables
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMap:
    """One megatron tensor ↔ one or more HF tensors.

    ``mcore``: megatron name suffix (within a layer for layer tensors, else the full name);
    ``hf``: HF name templates (``{L}`` layer, ``{E}`` expert); ``kind``: ``copy``, ``qkv``,
    ``glu``, ``vocab``, ``row`` (HF ``[1, n]``, megatron ``[n]``: Ernie 4.5's expert bias), or
    for one expert's slice ``x[{E}]`` of a fused HF expert tensor ``x`` ``fused_expert`` /
    ``fused_expert_glu`` / ``fused_expert_rows`` (:func:`expert_to_mcore`)."""

    mcore: str
    hf: Tuple[str, ...]
    kind: str = "copy"


@dataclass(frozen=True)
class Family:
    """One HF architecture family: its layer tables (dense and, for MoE, sparse layers) and
    its non-layer tensors."""

    model_type: str
    architectures: Tuple[str, ...]
    dense_layer: Tuple[TensorMap, ...]
    moe_layer: Tuple[TensorMap, ...] = ()
    global_maps: Tuple[TensorMap, ...] = ()


#: MoE families whose bridge registry maps no dense MLP (a Qwen3-MoE config may still make
#: layers dense with ``mlp_only_layers`` / ``decoder_sparse_step``): the dense MLP rows come
#: from the registry of the same vendor's dense family, whose HF names they share. Others
#: without dense MLP rows (MiniMax-M2) have MoE layers only.
_DENSE_MLP_FROM = {"qwen3_moe": "qwen3"}
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
#: families whose bridge registry maps no ``lm_head`` although their configs may untie it
#: (EXAONE-4.0-32B): the output layer row (``output_layer.weight`` <-> ``lm_head.weight``)
#: comes from the Llama registry, whose HF name it shares
_OUTPUT_LAYER_FROM = {"exaone4": "llama"}


#: hybrid families (a layer pattern, one layer type per layer: Nemotron-H; ``HYBRID_FAMILIES``):
#: their layer rows are kept together and each layer takes the rows of its type
#: (:data:`HYBRID_LAYER_ROWS`)
#: layer-pattern letter -> the megatron name prefixes of that layer type's rows: Mamba (its
#: mixer and its norm), attention (with its input norm), MLP (with its pre-MLP norm)
HYBRID_LAYER_ROWS = {
    "M": ("mixer.", "norm."),
    "*": ("self_attention.", "input_layernorm."),
    "-": ("mlp.linear_fc1.", "mlp.linear_fc2.", "pre_mlp_layernorm."),
}
#: HF names the bridge's registry gives that the pinned transformers does not write: Nemotron-H's
#: embedding, which transformers 5.12.1 saves as ``backbone.embedding.weight`` (the bridge
#: reads ``backbone.embeddings.weight``); ``tests/test_bridge_tables.py`` fails once the
#: bridge agrees with transformers
_HF_NAME_FIXES = {
    "nemotron_h": {"embedding.word_embeddings.weight": ("backbone.embedding.weight",)},
}


#: Falcon-H1: the bridge's registry names the tensors of its own FalconH1Model; ours is a
#: GPTModel whose layers hold the Mamba mixer inside their ``self_attention``
#: (:mod:`areal_mega.models.falcon_h1`): the registry's name -> ours, None for a name our
#: model does not have (the convolution's names of older megatron-core pins, a split up
#: projection the bridge's model never builds)
_MCORE_RENAMES = {
    "falcon_h1": {
        "decoder.final_norm.weight": "decoder.final_layernorm.weight",
        "norm.weight": "input_layernorm.weight",
        "mamba_mixer.conv1d.weight": None,
        "mamba_mixer.conv1d.bias": None,
        "mlp.linear_fc1_up.weight": None,
    }
}
#: the registry's Mamba mixer prefix -> ours (Falcon-H1)
_MCORE_PREFIX_RENAMES = {"falcon_h1": ("mamba_mixer.", "self_attention.mamba_mixer.")}


def _renamed(mt: str, maps: Tuple[TensorMap, ...]) -> Tuple[TensorMap, ...]:
    """``maps`` with the registry's megatron names made our model's (:data:`_MCORE_RENAMES`)."""
    names = _MCORE_RENAMES.get(mt)
    if names is None:
        return maps
    old, new = _MCORE_PREFIX_RENAMES[mt]
    out = []
    for m in maps:
        mcore = names.get(m.mcore, m.mcore)
        if mcore is None:
            continue
        if mcore.startswith(old):
            mcore = new + mcore[len(old) :]
        out.append(TensorMap(mcore, m.hf, m.kind))
    return tuple(out)


def _maps(rows) -> Tuple[TensorMap, ...]:
    return tuple(TensorMap(r["mcore"], tuple(r["hf"]), r["kind"]) for r in rows)


def _families(tables: dict) -> Dict[str, Family]:
    """Our :class:`Family` tables from Megatron-Bridge's registries
    (:mod:`areal_mega.checkpoint.bridge_tables`): an MoE family's dense layers take the
    attention rows and the dense MLP rows, its MoE layers the attention rows and every other
    ``mlp.`` row (router, experts, shared experts)."""
    fams = tables["families"]
    out = {}
    for mt, t in fams.items():
        layer, glob = _renamed(mt, _maps(t["layer"])), _renamed(mt, _maps(t["global"]))
        fixes = _HF_NAME_FIXES.get(mt, {})
        glob = tuple(TensorMap(m.mcore, fixes.get(m.mcore, m.hf), m.kind) for m in glob)
        if mt in _OUTPUT_LAYER_FROM and not any(m.mcore == "output_layer.weight" for m in glob):
            src = _maps(fams[_OUTPUT_LAYER_FROM[mt]]["global"])
            glob += tuple(m for m in src if m.mcore == "output_layer.weight")
        if mt in HYBRID_FAMILIES or not any(m.mcore.startswith("mlp.router.") for m in layer):
            out[mt] = Family(mt, (t["architecture"],), layer, (), glob)
            continue
        attn = tuple(m for m in layer if not m.mcore.startswith("mlp."))
        dense_mlp = tuple(m for m in layer if m.mcore in _DENSE_MLP)
        if not dense_mlp and mt in _DENSE_MLP_FROM:
            dense_mlp = tuple(
                m for m in _maps(fams[_DENSE_MLP_FROM[mt]]["layer"]) if m.mcore in _DENSE_MLP
            )
        sparse_mlp = tuple(
            m for m in layer if m.mcore.startswith("mlp.") and m.mcore not in _DENSE_MLP
        )
        out[mt] = Family(mt, (t["architecture"],), attn + dense_mlp, attn + sparse_mlp, glob)
    return out


FAMILIES: Dict[str, Family] = _families(load_tables())


def read_arch(source, *, where: Optional[str] = None, value_model: bool = False):
    """Read and validate an HF config (a model directory, a ``config.json`` path or a dict).

    Returns the engine builder's :class:`~areal_mega.models.builder.HFArch`. Raises
    :class:`UnsupportedModelError` naming the config file for an architecture or option this
    mapping does not handle. ``value_model``: also accept the family's one-label
    ``*ForSequenceClassification`` (see :mod:`areal_mega.checkpoint.value_model`)."""
    from areal_mega.models.builder import parse_hf_config

    if isinstance(source, dict):
        cfg, where = dict(source), where or "<config dict>"
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        where = where or path
        if not os.path.isfile(path):
            raise UnsupportedModelError(f"{path}: no config.json (not an HF model directory)")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{path}: not valid JSON ({e})") from None
    cfg = normalize_hf_config(cfg)
    mt = cfg.get("model_type")
    if gpu_only_reason(mt):
        raise UnsupportedModelError(
            f"{where}: model_type={mt!r} needs GPU-only kernels, which the CPU lacks: "
            f"{gpu_only_reason(mt)}"
        )
    if mt not in FAMILIES:
        why = f" ({not_built_reason(mt)})" if not_built_reason(mt) else ""
        raise UnsupportedModelError(
            f"{where}: model_type={mt!r} (architectures={cfg.get('architectures')}) is not "
            f"supported{why}; supported: {', '.join(FAMILIES)}"
        )
    archs = cfg.get("architectures") or []
    bad = [a for a in archs if a not in FAMILIES[mt].architectures]
    if value_model:
        problem = value_model_problem(cfg, FAMILIES[mt].architectures)
        if problem:
            raise UnsupportedModelError(f"{where}: {problem}")
    elif bad:
        raise UnsupportedModelError(
            f"{where}: architectures={bad} is not a causal LM of "
            f"model_type {mt!r} (expected {FAMILIES[mt].architectures})"
        )
    if mt == "qwen3_moe" and cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError(f"{where}: MoE shared experts are not supported")
    if cfg.get("attention_bias") and mt == "llama":
        raise UnsupportedModelError(f"{where}: llama attention_bias=True is not supported")
    try:
        arch = parse_hf_config(cfg)
    except (ValueError, KeyError, TypeError) as e:
        raise UnsupportedModelError(f"{where}: {e}") from None
    if arch.num_heads % arch.num_kv_heads:
        raise UnsupportedModelError(
            f"{where}: num_attention_heads={arch.num_heads} is not a "
            f"multiple of num_key_value_heads={arch.num_kv_heads}"
        )
    return arch


def maps_for(arch, layer: Optional[int] = None) -> Tuple[TensorMap, ...]:
    """The tensor maps of one layer (``layer`` given) or of the non-layer tensors."""
    fam = FAMILIES[arch.model_type]
    if layer is None:
        rows = tuple(
            m
            for m in fam.global_maps
            if not (m.mcore == "output_layer.weight" and arch.tie_word_embeddings)
        )
        if arch.model_type == "gemma4_text":
            rows = hf_mapping_gemma4.global_rows(arch, rows)
        return rows
    if arch.hybrid_layer_pattern is not None:
        letter = arch.hybrid_layer_pattern[layer]
        if letter not in HYBRID_LAYER_ROWS:
            raise UnsupportedModelError(
                f"{arch.model_type}: layer {layer} of type {letter!r} has no tensor mapping"
            )
        return tuple(m for m in fam.dense_layer if m.mcore.startswith(HYBRID_LAYER_ROWS[letter]))
    if arch.mamba_beside_attention and not arch.source_config().get("mamba_rms_norm"):
        return tuple(m for m in fam.dense_layer if m.mcore != _MAMBA_GATED_NORM)
    pattern = arch.moe_layer_pattern
    table = (
        fam.moe_layer if arch.is_moe and (pattern is None or pattern[layer]) else fam.dense_layer
    )
    if arch.model_type == "gemma4_text":  # its MoE rows are its dense ones rewritten
        table = hf_mapping_gemma4.layer_rows(arch, layer, fam.dense_layer)
    return tuple(
        _gated(arch, m)
        for m in table
        if optional_map_present(arch, m.mcore) and _attention_kind_present(arch, layer, m.mcore)
    )


def _gated(arch, m: TensorMap) -> TensorMap:
    """The fused QKV of a model with an attention output gate (Qwen3-Next: the bridge's
    ``QKVMapping`` reads the gate from the config) as kind ``gated_qkv``."""
    if m.kind == "qkv" and arch.attention_output_gate:
        return TensorMap(m.mcore, m.hf, "gated_qkv")
    return m


#: Falcon-H1's gated Mamba norm, which a config without ``mamba_rms_norm`` does not have
_MAMBA_GATED_NORM = "self_attention.mamba_mixer.norm.weight"
#: the gated delta-net's tensors (linear-attention layers); other ``self_attention.`` tensors
#: belong to the full-attention layers
_GDN_TENSORS = (
    "self_attention.in_proj.weight",
    "self_attention.conv1d.weight",
    "self_attention.A_log",
    "self_attention.dt_bias",
    "self_attention.out_norm.weight",
    "self_attention.out_proj.weight",
)


#: the DeepSeek sparse attention's indexer tensors, which a GLM-MoE-DSA layer of
#: ``indexer_types`` ``"shared"`` (reusing an earlier layer's top-k) does not have
_INDEXER_PREFIX = "self_attention.core_attention.indexer."


def _attention_kind_present(arch, layer: int, suffix: str) -> bool:
    """Whether layer ``layer`` has the attention tensor ``suffix``: in a model with gated
    delta-net layers (Qwen3-Next), its tensors on linear-attention layers, the others on the
    full-attention ones; in a DSA model (GLM-MoE-DSA), the indexer's on its ``"full"``
    indexer layers only."""
    if suffix.startswith(_INDEXER_PREFIX):
        return not (arch.dsa_shared_layers and arch.dsa_shared_layers[layer])
    if arch.linear_attention_layers is None or not suffix.startswith("self_attention."):
        return True
    return (suffix in _GDN_TENSORS) == bool(arch.linear_attention_layers[layer])


# ----------------------------------------------------------------------------------------------
# megatron parameter names
# ----------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def canonical_layer_suffix(suffix: str) -> Tuple[str, Optional[int]]:
    """Map a within-layer megatron name (local or TE spec) to the local-spec table form.

    Returns ``(suffix with the expert index replaced by "{E}", expert index or None)``."""
    suffix = _TE_ALIASES.get(suffix, suffix)
    m = _LOCAL_EXPERT_RE.match(suffix)
    if m:
        return f"mlp.experts.local_experts.{{E}}.{m.group(2)}", int(m.group(1))
    m = _TE_EXPERT_RE.match(suffix)
    if m:
        return f"mlp.experts.local_experts.{{E}}.{m.group(1)}.weight", int(m.group(2))
    if suffix.startswith("mlp.experts.weight"):
        raise UnsupportedModelError(
            f"{suffix}: legacy GroupedMLP weights are not supported; "
            "build with moe_grouped_gemm=False or TE grouped GEMM"
        )
    return suffix, None


def parse_mcore_name(name: str) -> Tuple[Optional[int], Optional[int], str]:
    """``decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight`` →
    ``(3, 1, "mlp.experts.local_experts.{E}.linear_fc2.weight")``; non-layer names give
    ``(None, None, name)``. Indices are as they appear (chunk-local / EP-local)."""
    m = _LAYER_RE.match(name)
    if not m:
        return None, None, re.sub(r"^(?:module\.)+", "", name)
    suffix, expert = canonical_layer_suffix(m.group(2))
    return int(m.group(1)), expert, suffix


def _find_map(arch, layer: Optional[int], suffix: str) -> TensorMap:
    for tm in maps_for(arch, layer):
        if tm.mcore == suffix:
            return tm
    where = "non-layer" if layer is None else f"layer {layer}"
    raise UnsupportedModelError(
        f"megatron tensor {suffix!r} ({where}) has no HF mapping for model_type {arch.model_type!r}"
    )


def hf_names_for(
    arch, layer: Optional[int], expert: Optional[int], suffix: str
) -> Tuple[Tuple[str, ...], str]:
    """HF names (global layer/expert indices) and the transform kind of one megatron tensor."""
    tm = _find_map(arch, layer, suffix)
    return tuple(h.format(L=layer, E=expert) for h in tm.hf), tm.kind


def _unrow(t: torch.Tensor) -> torch.Tensor:
    """An HF ``[1, n]`` tensor as megatron's ``[n]`` (kind ``row``)."""
    if t.dim() != 2 or t.shape[0] != 1:
        raise ValueError(f"expected a [1, n] tensor, got shape {tuple(t.shape)}")
    return t[0]


def to_mcore(
    arch, kind: str, hf_tensors: Sequence[torch.Tensor], *, padded_vocab_size: Optional[int] = None
) -> torch.Tensor:
    """HF tensors (in :func:`hf_names_for` order) → the full megatron tensor."""
    if kind == "copy":
        return hf_tensors[0]
    if kind == "row":
        return _unrow(hf_tensors[0])
    if kind == "qkv":
        return qkv_to_mcore(*hf_tensors, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    if kind == "glu":
        return glu_to_mcore(*hf_tensors)
    if kind == "vocab":
        return pad_vocab(hf_tensors[0], padded_vocab_size or hf_tensors[0].shape[0])
    if kind in FUSED_EXPERT_KINDS:
        return expert_to_mcore(kind, hf_tensors[0])
    if kind in GDN_KINDS:
        return hf_mapping_gdn.to_mcore(arch, kind, hf_tensors)
    if kind in GEMMA4_KINDS:
        return hf_mapping_gemma4.to_mcore(arch, kind, hf_tensors)
    raise ValueError(kind)


def to_hf(arch, kind: str, t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The full megatron tensor → HF tensors (in :func:`hf_names_for` order)."""
    if kind == "copy":
        return (t,)
    if kind == "row":
        return (t.unsqueeze(0),)
    if kind == "qkv":
        return qkv_to_hf(t, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    if kind == "glu":
        return glu_to_hf(t)
    if kind == "vocab":
        return (unpad_vocab(t, arch.vocab_size),)
    if kind in FUSED_EXPERT_KINDS:
        return (expert_to_hf(kind, t),)
    if kind in GDN_KINDS:
        return hf_mapping_gdn.to_hf(arch, kind, t)
    if kind in GEMMA4_KINDS:
        return hf_mapping_gemma4.to_hf(arch, kind, t)
    raise ValueError(kind)


def qkv_row_blocks(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]], List[Tuple[int, int]]]:
    """Row ranges of q, k and v inside the megatron fused QKV (one range per KV group)."""
    r = num_heads // num_kv_heads
    g = (r + 2) * head_dim
    q = [(i * g, i * g + r * head_dim) for i in range(num_kv_heads)]
    k = [(i * g + r * head_dim, i * g + (r + 1) * head_dim) for i in range(num_kv_heads)]
    v = [(i * g + (r + 1) * head_dim, (i + 1) * g) for i in range(num_kv_heads)]
    return q, k, v


def to_hf_segments(arch, kind: str, t: torch.Tensor) -> Tuple[List[torch.Tensor], ...]:
    """Like :func:`to_hf` but without copies: each HF tensor as a list of row-block views of
    ``t`` whose concatenation (dim 0) is that tensor."""
    if kind == "copy":
        return ([t],)
    if kind == "row":
        return ([t.unsqueeze(0)],)
    if kind == "vocab":
        return ([t[: arch.vocab_size]],)
    if kind == "glu":
        return tuple([x] for x in torch.chunk(t, 2, dim=0))
    if kind == "qkv":
        return tuple(
            [t[a:b] for a, b in blocks]
            for blocks in qkv_row_blocks(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        )
    if kind in FUSED_EXPERT_KINDS:  # one expert's slice, transposed: a copy
        return ([expert_to_hf(kind, t)],)
    if kind in GDN_KINDS:
        return hf_mapping_gdn.to_hf_segments(arch, kind, t)
    if kind in GEMMA4_KINDS:
        return hf_mapping_gemma4.to_hf_segments(arch, kind, t)
    raise ValueError(kind)


def to_mcore_segments(
    arch,
    kind: str,
    hf_names: Sequence[str],
    get: Callable[[str], torch.Tensor],
    *,
    padded_vocab_size: Optional[int] = None,
):
    """Like :func:`to_mcore` but streamed: yields row blocks whose concatenation (dim 0) is the
    megatron tensor, reading HF tensors through ``get`` only when needed (GLU: gate, then up;
    vocabulary padding: zero rows generated, not concatenated)."""
    if kind == "copy":
        yield get(hf_names[0])
    elif kind == "row":
        yield _unrow(get(hf_names[0]))
    elif kind == "glu":
        for n in hf_names:
            yield get(n)
    elif kind == "vocab":
        t = get(hf_names[0])
        pad = (padded_vocab_size or t.shape[0]) - t.shape[0]
        if pad < 0:
            raise ValueError(
                f"vocabulary of {t.shape[0]} rows exceeds padded size {padded_vocab_size}"
            )
        yield t
        if pad:
            yield t.new_zeros((pad,) + tuple(t.shape[1:]))
    elif kind == "qkv":
        q, k, v = (get(n) for n in hf_names)
        r, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
        for g in range(arch.num_kv_heads):
            yield q[g * r * hd : (g + 1) * r * hd]
            yield k[g * hd : (g + 1) * hd]
            yield v[g * hd : (g + 1) * hd]
    elif kind in FUSED_EXPERT_KINDS:
        yield expert_to_mcore(kind, get(hf_names[0]))
    elif kind in GDN_KINDS:
        yield from hf_mapping_gdn.to_mcore_segments(arch, kind, hf_names, get)
    elif kind in GEMMA4_KINDS:
        yield from hf_mapping_gemma4.to_mcore_segments(arch, kind, hf_names, get)
    else:
        raise ValueError(kind)


_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def hf_tensor_names(arch, *, with_head: bool = True) -> List[str]:
    """Every HF tensor name the model has (in HF save order: embeddings, layers, norm, head;
    ``with_head=False``: the trunk only, no ``lm_head``); a fused expert tensor once, an HF
    tensor that several megatron names map to (a module's old and new name) once."""
    names = [h for tm in maps_for(arch) if tm.mcore == _VOCAB_TENSORS[0] for h in tm.hf]
    for layer in range(arch.num_layers):
        for tm in maps_for(arch, layer):
            if tm.kind in FUSED_EXPERT_KINDS:
                names += [split_row_name(h.format(L=layer, E=0))[0] for h in tm.hf]
                continue
            experts = range(arch.num_experts) if "{E}" in tm.mcore else [None]
            for e in experts:
                names += [h.format(L=layer, E=e) for h in tm.hf]
    names += [h for tm in maps_for(arch) if tm.mcore not in _VOCAB_TENSORS for h in tm.hf]
    if with_head and not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return list(dict.fromkeys(names))

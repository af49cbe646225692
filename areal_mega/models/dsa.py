"""GLM-MoE-DSA (``model_type: glm_moe_dsa``, ``GlmMoeDsaForCausalLM``, GLM-5) on megatron-core:
GLM-4-MoE-Lite's multi-latent attention and DeepSeek-style router (:mod:`areal_mega.models.mla`)
with DeepSeek sparse attention (DSA): a lightning indexer scores every earlier token for each
query (``Σ_h w_h · relu(q_h · k)``, its own small query / key projections, a LayerNorm on its
keys, rotary in the half-split layout) and the attention sees only the ``index_topk``
best-scoring ones.

megatron-core 0.19 builds DSA as ``AbsorbedMLASelfAttention`` around a ``DSAttention`` core
(``experimental_attention_variant="dsa"``), whose indexer and sparse attention are its own torch
code on every device (its fused kernels, TileLang or cuDNN, are optional and off:
``dsa_kernel_backend="none"``). Its layer-spec builder takes a backend; megatron's local one has
no ``linear()`` (the latent down projections and the indexer's projections, duplicated across
TP) and the block builder accepts TransformerEngine only, so :func:`dsa_block_spec` builds the
layers with :class:`LocalDSABackend` and takes this stage's share as megatron's block builder
does. The absorbed MLA accepts a replicated down projection by identity only (TE's
``TELinear``, or megatron's torch ``Linear``, which it imports beside TE's modules: None without
TE, and its checkpoint sharding assumes TP-split weights): the CPU compatibility patch
``absorbed_mla_local_linear`` (:mod:`areal_mega.compat.megatron_cpu`) names
:class:`~areal_mega.compat.replicated_linear.ReplicatedLinear` there.

The fields come from Megatron-Bridge's GLM-5 provider (:mod:`areal_mega.models.bridge_provider`
corrects what it reads wrong). The indexer is not trained: it sees detached inputs and its top-k
is not differentiable, so without megatron's indexer loss (``dsa_indexer_loss_coeff``, the
KL to the attention's scores; 0 here, RL keeps the checkpoint's indexer, as transformers'
training does) its parameters get no gradient.

Top-k sharing: a ``"shared"`` layer of ``indexer_types`` has no indexer and attends to the
top-k of the last ``"full"`` layer before it, in transformers and in megatron-core alike; megatron
takes the schedule as a frequency and an offset (``dsa_indexer_topk_freq``,
``dsa_indexer_skip_topk_offset``), which :func:`indexer_share_schedule` reads off the layer list.
A pipeline stage must start on a ``"full"`` layer (:func:`dsa_block_spec` says which does not).

Refused (``ValueError`` naming the key): ``indexer_types`` that no frequency and offset give (or
whose first layer is ``"shared"``), ``rope_interleave=False`` and attention biases (as every MLA
family).
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer

from areal_mega.compat.replicated_linear import ReplicatedLinear
from areal_mega.models.mla import glm4_moe_lite_fields

__all__ = [
    "DSA_MODEL_TYPES",
    "indexer_types_of",
    "glm_moe_dsa_fields",
    "indexer_share_schedule",
    "stage_start_error",
    "LocalDSABackend",
    "dsa_block_spec",
]

DSA_MODEL_TYPES = ("glm_moe_dsa",)


def indexer_types_of(hf: dict) -> list:
    """The config's ``indexer_types`` (every layer ``"full"`` when absent; a config made by
    transformers always writes them, from ``index_topk_freq`` / ``index_skip_topk_offset``)."""
    return list(hf.get("indexer_types") or ["full"] * int(hf["num_hidden_layers"]))


def glm_moe_dsa_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``glm_moe_dsa`` config: those
    of GLM-4-MoE-Lite (MLA, router, dense layers from ``mlp_layer_types``) and the indexer's
    heads, head size and top-k, and its shared layers (:func:`indexer_share_schedule` checks
    them). ``ValueError`` naming the key of what is not built."""
    types = indexer_types_of(dict(hf, num_hidden_layers=n_layers))
    indexer_share_schedule(types)
    fields = glm4_moe_lite_fields(hf, n_layers)
    fields["dsa_shared_layers"] = tuple(int(t == "shared") for t in types)
    fields["dsa_indexer"] = (
        int(hf["index_n_heads"]),
        int(hf["index_head_dim"]),
        int(hf["index_topk"]),
    )
    return fields


def _shares(n_layers: int, freq: int, offset: int) -> list:
    """megatron-core's skip layers (True: reusing an earlier top-k) of ``n_layers`` at
    ``freq`` / ``offset``, as its ``DSAttention`` decides them."""
    return [is_dsa_skip_topk_layer(n, offset, freq) for n in range(1, n_layers + 1)]


def indexer_share_schedule(indexer_types: Sequence[str]) -> tuple:
    """megatron-core's ``(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset)`` that makes
    exactly the ``"shared"`` layers of transformers' ``indexer_types`` reuse the top-k of the
    last ``"full"`` layer before them: ``(1, 0)`` when every layer is ``"full"``, else the
    smallest frequency (then offset) that does. ``ValueError`` naming ``indexer_types`` for
    another value, a ``"shared"`` first layer (no top-k to reuse) or a list no frequency and
    offset give."""
    types = list(indexer_types)
    unknown = sorted({t for t in types if t not in ("full", "shared")})
    if unknown:
        raise ValueError(f"indexer_types={types!r}: {unknown} is not 'full' or 'shared'")
    shared = [t == "shared" for t in types]
    if not any(shared):
        return 1, 0
    if shared[0]:
        raise ValueError(
            f"indexer_types={types!r}: the first layer is 'shared' but no earlier layer "
            "computes a top-k for it to reuse"
        )
    for freq in range(2, len(types) + 1):
        for offset in range(1, len(types) + 1):
            if _shares(len(types), freq, offset) == shared:
                return freq, offset
    raise ValueError(
        f"indexer_types={types!r}: megatron-core shares the indexer's top-k on a schedule of "
        "one 'full' layer every dsa_indexer_topk_freq layers from dsa_indexer_skip_topk_offset "
        "on, and no frequency and offset give this list"
    )


def stage_start_error(n_layers: int, freq: int, offset: int, first: int) -> Optional[str]:
    """Why a pipeline stage whose first layer is ``first`` (0-based) cannot be built under the
    top-k sharing ``freq`` / ``offset``, or None: a ``"shared"`` first layer's top-k would come
    from an earlier stage, which megatron-core does not pass between stages."""
    if freq <= 1 or not _shares(n_layers, freq, offset)[first]:
        return None
    return (
        f"this pipeline stage starts at layer {first} (0-based), a 'shared' indexer layer "
        f"(indexer_types; dsa_indexer_topk_freq={freq}, dsa_indexer_skip_topk_offset="
        f"{offset}): its top-k comes from an earlier stage, which megatron-core does not pass "
        "between stages. Choose a pipeline split where every stage starts on a 'full' layer"
    )


class LocalDSABackend(LocalSpecProvider):
    """megatron's local spec backend with the ``linear()`` its DSA spec asks for (the latent
    down projections and the indexer's projections, replicated across TP):
    :class:`~areal_mega.compat.replicated_linear.ReplicatedLinear`. A column-parallel down
    projection, which the absorbed MLA also accepts, gathers its output over TP and splits the
    gradient back without summing it: under sequence parallelism each rank's queries reach
    every key, so the keys' rotary part would lose the other ranks' gradient."""

    def linear(self) -> type:
        return ReplicatedLinear


def dsa_block_spec(config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk): megatron's DSA layers (absorbed MLA with
    the DSA core attention; MoE or dense MLPs by ``config.moe_layer_freq``) on its local
    layers (:class:`LocalDSABackend`). ``ValueError`` for
    TransformerEngine's spec, which is not wired."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if use_te:
        raise ValueError(
            f"{', '.join(DSA_MODEL_TYPES)} run on megatron's local layer spec only "
            "(model.attention_backend other than TransformerEngine)"
        )
    backend = LocalDSABackend()
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    error = n and stage_start_error(
        config.num_layers,
        config.dsa_indexer_topk_freq,
        config.dsa_indexer_skip_topk_offset,
        offset,
    )
    if error:
        raise ValueError(error)
    return TransformerBlockSubmodules(
        layer_specs=[copy.deepcopy(s) for s in layers[offset : offset + n]],
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
    )

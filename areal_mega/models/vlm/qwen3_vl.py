"""Qwen3-VL's model from Megatron-Bridge's own classes, on megatron-core's local layers.

The bridge's ``Qwen3VLModelProvider.provide`` builds ``Qwen3VLModel`` from TransformerEngine
layers only (TE's GPT layer spec for the language model, TE's ViT spec and TE norm / linear
patch mergers for the vision tower). :func:`build_qwen3_vl_model` builds the same classes
(``Qwen3VLModel``: the deepstack forward, its multimodal positions and interleaved RoPE;
``Qwen3VLVisionModel``: patch embedding, interpolated position embedding, the blocks that emit
the deepstack features, the mergers) with megatron-core's local layers: the language model on
our packed attention (:class:`~areal_mega.models.varlen_attention.VarlenDotProductAttention`,
causal), the vision tower on :class:`VisionVarlenAttention` (each image's patches attend to each
other both ways, as transformers' vision blocks do). The bridge's constructor builds the vision
tower only from TE's spec, so the model is made without it (``add_encoder=False``) and
:func:`qwen3_vl_vision_model` is set as its ``vision_model``, built as the constructor builds it
with the local spec, its patch mergers' activation the exact GELU transformers' have (the
bridge gives them the blocks' tanh approximation: about 1e-5 on the logits of the tiny model).
Under sequence parallelism the deepstack features' gradient is summed over the
tensor-parallel ranks (:func:`_deepstack_grads_summed_over_tp`): the bridge's forward slices
them per rank without it, and the tower's gradients were each rank's part only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_mega.compat.bridge_import import import_bridge_modules
from areal_mega.models.varlen_attention import VarlenDotProductAttention, packed_slot_bounds

__all__ = [
    "VisionVarlenAttention",
    "qwen3_vl_vision_model",
    "merger_modules",
    "build_qwen3_vl_model",
]


class VisionVarlenAttention(VarlenDotProductAttention):
    """Bidirectional attention within each packed slot (one image frame's patches), as the
    vision blocks of transformers' Qwen3-VL run it; THD only (the vision tower always packs
    its images)."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """THD ``query`` / ``key`` / ``value`` [T, heads, d] -> [T, heads·d]."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("the vision tower's attention runs on packed (THD) images only")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the vision attention")
        p = self.attention_dropout.p if self.training else 0.0
        bounds = packed_slot_bounds(packed_seq_params)
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            q, k, v = (x[a:b].transpose(0, 1)[None] for x in (query, key, value))
            o = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, scale=self.sdpa_scale, enable_gqa=q.shape[1] != k.shape[1]
            )
            out.append(o[0].transpose(0, 1))
        o = torch.cat(out) if out else query.new_zeros(query.shape)
        return o.reshape(o.shape[0], -1)


def qwen3_vl_vision_model(provider):
    """The bridge's ``Qwen3VLVisionModel`` of a (finalised) Qwen3-VL provider, built as
    ``Qwen3VLModel.__init__`` builds it, on the local ViT spec with
    :class:`VisionVarlenAttention` and local norm / linear patch mergers."""
    import_bridge_modules()  # Qwen3-VL's modules without every model family
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.attention import Qwen3VLSelfAttention
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_config import (
        get_vision_model_config,
    )
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import PatchMergerSubmodules
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.vision_model import (
        Qwen3VLVisionModel,
    )
    from megatron.core.models.vision.vit_layer_specs import LNImpl, get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.module = Qwen3VLSelfAttention
    spec.submodules.self_attention.submodules.core_attention = VisionVarlenAttention
    config = get_vision_model_config(provider.vision_config, megatron_config=provider)
    config.pipeline_model_parallel_size = 1
    config.first_pipeline_num_layers = None
    config.params_dtype = provider.params_dtype
    model = Qwen3VLVisionModel(
        config,
        spec,
        PatchMergerSubmodules(
            patch_norm=LNImpl, linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        pre_process=True,
        post_process=True,
        pg_collection=provider._pg_collection,
    )
    for merger in merger_modules(model):
        merger.activation_func = F.gelu
    return model


def merger_modules(vision_model) -> list:
    """The vision tower's patch mergers: the last one and the deepstack ones. The bridge's
    take the blocks' activation (tanh-approximated GELU); transformers' mergers use the exact
    GELU (``nn.GELU()``), which :func:`qwen3_vl_vision_model` sets on them
    (``tests/test_qwen3_vl.py`` fails once the bridge's mergers have it themselves)."""
    return [vision_model.merger, *vision_model.decoder.deepstack_merger_list]


def _deepstack_grads_summed_over_tp(module, args, output):
    """Forward hook of the vision tower under sequence parallelism: its deepstack features
    as they are, their gradient summed over the tensor-parallel ranks. The bridge's forward
    gives each rank the slice of the features its sequence part holds (``split_deepstack_embs``,
    a plain slice), so each rank's backward reaches the tower (computed whole on every rank)
    with its slice's gradient only: summed, it is the whole gradient (as the image features'
    gradient is, gathered by the sequence-parallel scatter's backward)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    hidden, deepstack = output
    group = module.tp_group
    return hidden, [copy_to_tensor_model_parallel_region(x, group=group) for x in deepstack]


def build_qwen3_vl_model(provider, language_spec, *, pre_process: bool, post_process: bool):
    """The bridge's ``Qwen3VLModel`` of a (finalised) provider with ``language_spec`` (a local
    GPT layer spec; the bridge sets its attention module to ``Qwen3VLSelfAttention``) and the
    vision tower of :func:`qwen3_vl_vision_model` on the first pipeline stage; the provider's
    freeze switches applied as its ``provide`` applies them."""
    import_bridge_modules()  # Qwen3-VL's modules without every model family
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel

    model = Qwen3VLModel(
        language_transformer_config=provider,
        language_transformer_layer_spec=language_spec,
        vision_transformer_config=provider.vision_config,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=provider._pg_collection,
        add_encoder=False,  # the constructor's vision tower is TE's: ours is set below
        add_decoder=True,
    )
    if pre_process:
        model.vision_model = qwen3_vl_vision_model(provider)
        model.add_encoder = True
        if provider.sequence_parallel and provider.tensor_model_parallel_size > 1:
            model.vision_model.register_forward_hook(_deepstack_grads_summed_over_tp)
    if (
        provider.freeze_language_model
        or provider.freeze_vision_model
        or provider.freeze_vision_projection
    ):
        model.freeze(
            freeze_language_model=provider.freeze_language_model,
            freeze_vision_model=provider.freeze_vision_model,
            freeze_vision_projection=provider.freeze_vision_projection,
        )
    return model

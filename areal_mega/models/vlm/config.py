"""Which vision-language configs the engine builds, and the keys it refuses.

Qwen2.5-VL (``model_type`` ``qwen2_5_vl``, transformers' ``Qwen2_5_VLForConditionalGeneration``):
its language model is Qwen2's (QKV bias, RMSNorm, SwiGLU) with multimodal RoPE. A config key
whose value our build does not reproduce is refused naming it (transformers would apply it):
the text model's sliding window, a RoPE scaling other than the multimodal sections, an
activation other than SiLU.
"""

from __future__ import annotations

import json

from areal_mega.dataplane.multimodal import VisionSpec
from areal_mega.models.bridge_provider import VL_PROVIDER_FAMILIES, hf_config_object
from areal_mega.models.builder import HFArch

__all__ = [
    "VL_MODEL_TYPES",
    "is_vl_config",
    "check_vl_config",
    "vl_text_arch",
    "vision_spec",
    "DEFAULT_MAX_PATCHES",
    "DEFAULT_MAX_IMAGES",
    "check_qwen3_vl_config",
]

DEFAULT_MAX_PATCHES = 1 << 16
"""Patches one sample may carry by default: one image at the Qwen2-VL processors' default
``max_pixels`` (12,845,056 = 65,536 patches of 14²), about 300 MB of float32 pixels."""
DEFAULT_MAX_IMAGES = 64
"""Images one sample may carry by default."""

VL_MODEL_TYPES = VL_PROVIDER_FAMILIES


def is_vl_config(hf: dict) -> bool:
    """Whether ``hf`` is a vision-language config this package builds."""
    return hf.get("model_type") in VL_MODEL_TYPES


def check_vl_config(hf: dict):
    """transformers' config object of ``hf`` after refusing what the build does not reproduce
    (``ValueError`` naming the key)."""
    mt = hf.get("model_type")
    if mt not in VL_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not a vision-language family we build")
    if mt == "qwen3_vl":
        return check_qwen3_vl_config(hf)
    cfg = hf_config_object(hf)
    text = cfg.text_config
    if getattr(text, "use_sliding_window", False):
        raise ValueError("text_config.use_sliding_window=True is not supported (full attention)")
    rope = dict(text.rope_parameters or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"text_config.rope_parameters.rope_type={kind!r} is not supported")
    if "mrope_section" not in rope:
        raise ValueError("text_config.rope_parameters has no mrope_section")
    head_dim = text.hidden_size // text.num_attention_heads
    if sum(rope["mrope_section"]) != head_dim // 2:
        raise ValueError(
            f"text_config.rope_parameters.mrope_section={rope['mrope_section']} does not sum to "
            f"head_dim/2={head_dim // 2}"
        )
    if text.hidden_act != "silu":
        raise ValueError(f"text_config.hidden_act={text.hidden_act!r} is not supported (silu)")
    return cfg


def vl_text_arch(hf: dict) -> HFArch:
    """The language model's :class:`~areal_mega.models.builder.HFArch` (what the engine reads
    around the model: vocabulary, sizes, tied embeddings), ``model_type`` the vision-language
    one; the model itself is built from the whole config (:mod:`areal_mega.models.vlm.builder`).
    Qwen2.5-VL's language model has a QKV bias and ``hidden / heads`` heads; Qwen3-VL's is
    Qwen3's (QK norms, no QKV bias, its own ``head_dim``)."""
    cfg = check_vl_config(hf)
    text = cfg.text_config
    heads = int(text.num_attention_heads)
    qwen3 = hf["model_type"] == "qwen3_vl"
    return HFArch(
        model_type=hf["model_type"],
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(text.num_key_value_heads or heads),
        head_dim=int((qwen3 and getattr(text, "head_dim", None)) or int(text.hidden_size) // heads),
        ffn_hidden_size=int(text.intermediate_size),
        max_position_embeddings=int(text.max_position_embeddings),
        rope_theta=float(text.rope_parameters["rope_theta"]),
        rms_norm_eps=float(text.rms_norm_eps),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        qkv_bias=not qwen3,
        qk_norm=qwen3,
        initializer_range=float(text.initializer_range),
        hf_json=json.dumps(hf, sort_keys=True, default=str),
    )


def vision_spec(
    hf: dict, *, max_patches: int = DEFAULT_MAX_PATCHES, max_images: int = DEFAULT_MAX_IMAGES
) -> VisionSpec:
    """What the model of the vision-language config ``hf`` accepts on the data plane
    (:class:`~areal_mega.dataplane.multimodal.VisionSpec`): its ``image_token_id``, the
    vision tower's ``spatial_merge_size`` and patch size ``in_channels · temporal_patch_size ·
    patch_size²`` (the image processor's ``pixel_values`` rows), and the bounds."""
    cfg = check_vl_config(hf)
    v = cfg.vision_config
    channels = int(getattr(v, "in_channels", getattr(v, "in_chans", 3)))
    return VisionSpec(
        image_token_id=int(cfg.image_token_id),
        merge_size=int(v.spatial_merge_size),
        patch_dim=channels * int(v.temporal_patch_size) * int(v.patch_size) ** 2,
        max_patches=int(max_patches),
        max_images=int(max_images),
    )


def check_qwen3_vl_config(hf: dict):
    """Qwen3-VL (``qwen3_vl``): transformers' config object after refusing what the build does
    not reproduce (``ValueError`` naming the key): an attention bias (transformers puts one on
    the output projection too, megatron's ``add_qkv_bias`` on the QKV only), a RoPE scaling
    other than the multimodal sections, multimodal sections not summing to half the head dim,
    a text activation other than SiLU, a vision activation other than tanh-approximated GELU
    (the bridge's vision config fixes it) or a vision position grid that is not square."""
    cfg = hf_config_object(hf)
    text, vision = cfg.text_config, cfg.vision_config
    if getattr(text, "attention_bias", False):
        raise ValueError(
            "text_config.attention_bias=True is not supported (transformers adds an output "
            "projection bias that the bridge's model lacks)"
        )
    rope = dict(text.rope_parameters or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"text_config.rope_parameters.rope_type={kind!r} is not supported")
    section = rope.get("mrope_section", [24, 20, 20])  # transformers' and the bridge's default
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    if sum(section) != head_dim // 2:
        raise ValueError(
            f"text_config.rope_parameters.mrope_section={section} does not sum to "
            f"head_dim/2={head_dim // 2}"
        )
    if text.hidden_act != "silu":
        raise ValueError(f"text_config.hidden_act={text.hidden_act!r} is not supported (silu)")
    if vision.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(
            f"vision_config.hidden_act={vision.hidden_act!r} is not supported (gelu_pytorch_tanh)"
        )
    side = int(vision.num_position_embeddings**0.5)
    if side * side != vision.num_position_embeddings:
        raise ValueError(
            f"vision_config.num_position_embeddings={vision.num_position_embeddings} is not a "
            "square grid"
        )
    return cfg

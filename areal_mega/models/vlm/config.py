"""Which vision-language configs the engine builds, and the keys it refuses.

Qwen2.5-VL (``model_type`` ``qwen2_5_vl``, transformers' ``Qwen2_5_VLForConditionalGeneration``):
its language model is Qwen2's (QKV bias, RMSNorm, SwiGLU) with multimodal RoPE. A config key
whose value our build does not reproduce is refused naming it (transformers would apply it):
the text model's sliding window, a RoPE scaling other than the multimodal sections, an
activation other than SiLU.
"""

from __future__ import annotations

from areal_mega.models.bridge_provider import VL_PROVIDER_FAMILIES, hf_config_object

__all__ = ["VL_MODEL_TYPES", "is_vl_config", "check_vl_config"]

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

"""A tiny random-weight Qwen2.5-VL or Qwen3-VL with its image processor and our character
tokenizer.

:func:`areal_mega.models.tiny.make_tiny_model` with ``arch="qwen2_5_vl"`` or ``"qwen3_vl"``
calls :func:`make_tiny_vl`. The tokenizer is the tiny models' character tokenizer with
Qwen2.5-VL's four vision tokens added last (``<|vision_start|>``, ``<|vision_end|>``,
``<|image_pad|>``, ``<|video_pad|>``) and a chat template that renders an ``{"type": "image"}``
item of a message as ``<|vision_start|><|image_pad|><|vision_end|>``
(:func:`areal_mega.models.vlm.inputs.encode_sample` expands the placeholder to the image's
token count). The image processor is transformers' PIL Qwen2-VL processor sized for small
images (28x28 to 56x56 pixels: one to four merged patches); the weights are transformers'
initialisation with random norm gains and biases (see :func:`_make_features_bite`).
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_mega.models.tiny_configs import text_keys

__all__ = [
    "VISION_TOKENS",
    "IMAGE_CHAT_TEMPLATE",
    "add_vision_tokens",
    "tiny_qwen25_vl_config",
    "tiny_qwen3_vl_config",
    "make_tiny_vl",
]

#: Qwen2.5-VL's vision tokens, in the order they are added to the tiny tokenizer
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: one user turn rendered verbatim; an image item becomes the vision placeholder
IMAGE_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)
#: smallest and largest image area the tiny processor keeps (one to four merged patches)
MIN_PIXELS = 28 * 28
MAX_PIXELS = 56 * 56


def _mrope_section(head_dim: int, section) -> list:
    """The rotary channels per axis: the spec's, else half the rotary pairs split 1:1.5:1.5
    (the released models' 16:24:24)."""
    if section is not None:
        section = [int(x) for x in section]
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section={section} must sum to head_dim/2={head_dim // 2}")
        return section
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def _text_keys(spec, head_dim: int, vocab_size: int, pad_id: int, eos_id: int) -> dict:
    """The text config's keys shared with the text-only tiny families
    (:func:`~areal_mega.models.tiny_configs.text_keys`; the embeddings' tying is the
    vision-language config's own key), with multimodal RoPE."""
    keys = text_keys(spec, vocab_size, pad_id, eos_id)
    keys["rope_parameters"] = dict(
        keys["rope_parameters"], mrope_section=_mrope_section(head_dim, spec.mrope_section)
    )
    return keys


def tiny_qwen25_vl_config(spec, vocab_size: int, pad_id: int, eos_id: int):
    """transformers' ``Qwen2_5_VLConfig`` of a :class:`~areal_mega.models.tiny.TinyModelSpec`;
    the vision token ids are the last four of the vocabulary (:data:`VISION_TOKENS`)."""
    from transformers import Qwen2_5_VLConfig

    if spec.sliding_window is not None:
        raise ValueError("sliding_window: the tiny qwen2_5_vl has none")
    head_dim = spec.hidden_size // spec.num_heads
    if spec.head_dim not in (None, head_dim):
        raise ValueError("head_dim: arch='qwen2_5_vl' derives it from hidden_size/num_heads")
    ids = {t: vocab_size - len(VISION_TOKENS) + i for i, t in enumerate(VISION_TOKENS)}
    text = dict(_text_keys(spec, head_dim, vocab_size, pad_id, eos_id), use_sliding_window=False)
    # window attention over one merged patch (window_size / patch_size / merge_size = 1) in the
    # first blocks, full attention in the last: both bite on images of two or more tokens
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_heads=spec.vision_num_heads,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=28,
        out_hidden_size=spec.hidden_size,
        fullatt_block_indexes=[spec.vision_depth - 1],
        initializer_range=spec.initializer_range,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def _make_features_bite(model, seed: int) -> None:
    """Random norm gains (transformers starts them at one) and biases (at zero): a norm or a
    bias mapped to another's place, or dropped, changes the logits."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2] or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def add_vision_tokens(tok):
    """The tiny character tokenizer ``tok`` with :data:`VISION_TOKENS` added (last ids) and
    :data:`IMAGE_CHAT_TEMPLATE` (in place; returned)."""
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = IMAGE_CHAT_TEMPLATE
    return tok


def image_processor():
    """transformers' PIL Qwen2-VL image processor of the tiny model (no torchvision needed)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )


#: Qwen3-VL's patches are 16 pixels wide: one to four merged patches are 32..64-pixel images
QWEN3_VL_MIN_PIXELS = 32 * 32
QWEN3_VL_MAX_PIXELS = 64 * 64


def tiny_qwen3_vl_config(spec, vocab_size: int, pad_id: int, eos_id: int):
    """transformers' ``Qwen3VLConfig`` of a :class:`~areal_mega.models.tiny.TinyModelSpec`: the
    language model Qwen3's (QK norms, no QKV bias) with interleaved multimodal RoPE; a vision
    tower of ``spec.vision_depth`` blocks whose first block's features go into the first
    language layer (deepstack), a 4x4 grid of learnt position embeddings (interpolated to each
    image's grid); the vision token ids are the last four of the vocabulary."""
    from transformers import Qwen3VLConfig

    if spec.sliding_window is not None:
        raise ValueError("sliding_window: the tiny qwen3_vl has none")
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    ids = {t: vocab_size - len(VISION_TOKENS) + i for i, t in enumerate(VISION_TOKENS)}
    text = dict(
        _text_keys(spec, head_dim, vocab_size, pad_id, eos_id),
        head_dim=head_dim,
        attention_bias=False,
    )
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_heads=spec.vision_num_heads,
        hidden_act="gelu_pytorch_tanh",
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=spec.hidden_size,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
        initializer_range=spec.initializer_range,
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def qwen3_vl_image_processor():
    """transformers' PIL image processor of the tiny Qwen3-VL (the one ``AutoImageProcessor``
    picks for ``qwen3_vl`` without torchvision): 16-pixel patches, images of 32..64 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        min_pixels=QWEN3_VL_MIN_PIXELS,
        max_pixels=QWEN3_VL_MAX_PIXELS,
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def _qwen3_vl_features_bite(model, seed: int) -> None:
    """As :func:`_make_features_bite`, and the learnt vision position embeddings scaled up
    (transformers starts them at the initializer's small scale): a wrong interpolation of the
    grid changes the logits."""
    import torch

    _make_features_bite(model, seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("visual.pos_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=g))


def make_tiny_vl(out: Path, spec, tok) -> Path:
    """Write the tiny vision-language model of ``spec.arch`` (``qwen2_5_vl`` or ``qwen3_vl``:
    config, safetensors, tokenizer with chat template, image processor) to ``out``; ``tok``:
    the tiny models' character tokenizer (:func:`areal_mega.models.tiny.build_char_tokenizer`),
    which gets the vision tokens (the last ids)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    qwen3 = spec.arch == "qwen3_vl"
    tok = add_vision_tokens(tok)
    make_config = tiny_qwen3_vl_config if qwen3 else tiny_qwen25_vl_config
    cfg = make_config(spec, len(tok), tok.pad_token_id, tok.eos_token_id)
    for i, t in enumerate(VISION_TOKENS):
        if tok.convert_tokens_to_ids(t) != len(tok) - len(VISION_TOKENS) + i:
            raise RuntimeError(f"{t}: not at its id in the tiny tokenizer")
    torch.manual_seed(spec.seed)
    model_cls = Qwen3VLForConditionalGeneration if qwen3 else Qwen2_5_VLForConditionalGeneration
    model = model_cls._from_config(cfg, dtype=torch.float32)
    (_qwen3_vl_features_bite if qwen3 else _make_features_bite)(model, spec.seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (qwen3_vl_image_processor if qwen3 else image_processor)().save_pretrained(out)
    (out / "tiny_model_spec.json").write_text(json.dumps(spec.__dict__, indent=2))
    return out

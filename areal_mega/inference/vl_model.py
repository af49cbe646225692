"""The model side of images on the CPU rollout server (Qwen2.5-VL and Qwen3-VL checkpoints):
which configs are vision-language, their vision special tokens, a prompt's images as the model
takes them, and the keyword arguments of a forward over prompts with images.

transformers' Qwen2.5-VL and Qwen3-VL keep the multimodal rope offset of the last prompt they
saw on the model object (``model.model.rope_deltas``), which is one value for a whole
``generate`` call; the rollout engine batches rows of different prompts continuously, so it
never lets the model compute positions. :func:`vl_forward_inputs` computes each prompt row's
3-D positions with the model's ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)``
(the same signature in both families; an image advances the text position by ``max(h, w) /
merge``) and returns each row's next text position (the largest position + 1, i.e. the prompt
length plus the row's rope delta); decode steps continue from there, one position per token,
the same on the three axes (what transformers' ``generate`` does with its ``rope_deltas``).

:func:`vision_token_ids` are the vision special tokens a rollout must never produce; the engine
gives them ``-inf`` before sampling, as a ``logit_bias`` of ``-inf`` would, so the reported
logprob is that of the distribution sampled from (SGLang's semantics for a bias), which differs
from the full-vocabulary one by ``log(1 - p(vision tokens))``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import torch

__all__ = [
    "PromptImages",
    "checkpoint_vision_token_ids",
    "is_vision_config",
    "vision_token_ids",
    "vl_forward_inputs",
]

#: the config fields naming vision special tokens (Qwen2-VL / Qwen2.5-VL spelling)
VISION_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "vision_token_id",
)
#: vision special tokens of the Qwen VL tokenizers, looked up by name when the tokenizer has them
VISION_TOKEN_NAMES = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
)


def is_vision_config(cfg) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(cfg, "vision_config", None) is not None


def vision_token_ids(cfg, tokenizer=None) -> list:
    """The vision special token ids of a VL config (and its tokenizer's, by name), sorted."""
    ids = {int(v) for f in VISION_TOKEN_FIELDS if (v := getattr(cfg, f, None)) is not None}
    if tokenizer is not None:
        unk = getattr(tokenizer, "unk_token_id", None)
        for name in VISION_TOKEN_NAMES:
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid >= 0 and tid != unk:
                ids.add(tid)
    return sorted(ids)


@dataclass
class PromptImages:
    """The images of one prompt as the model takes them: ``pixel_values`` ``[patches,
    C·t·p·p]``, ``image_grid_thw`` ``[images, 3]``; ``images``: the decoded PIL images. Keys
    and values computed with them are never cached beyond their own request (no prefix cache
    serves a vision-language model)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images: list


def vl_forward_inputs(model, ids: torch.Tensor, images: Sequence[Optional[PromptImages]]):
    """Keyword arguments of a Qwen2.5-VL / Qwen3-VL forward over prompt rows ``ids`` ``[n,
    S]`` (equal lengths, no padding) whose images are ``images`` (one entry per row, None for a
    row without), and each row's next text position (a list): ``input_ids``, ``position_ids``
    ``[3, n, S]`` from the model's ``get_rope_index``, and with images ``pixel_values``,
    ``image_grid_thw`` (the rows' images in row order) and ``mm_token_type_ids``."""
    n, S = ids.shape
    with_images = [im for im in images if im is not None]
    if not with_images:
        pos = torch.arange(S).view(1, 1, S).expand(3, n, S)
        return {"input_ids": ids, "position_ids": pos}, [S] * n
    mm = (ids == int(model.config.image_token_id)).to(torch.int)
    grid = torch.cat([im.image_grid_thw for im in with_images])
    pos, delta = model.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid)
    kwargs = {
        "input_ids": ids,
        "position_ids": pos,
        "pixel_values": torch.cat([im.pixel_values for im in with_images]),
        "image_grid_thw": grid,
        "mm_token_type_ids": mm,
    }
    return kwargs, [S + int(d) for d in delta.view(-1)]


def checkpoint_vision_token_ids(model_dir, tokenizer=None) -> list:
    """:func:`vision_token_ids` of the checkpoint in ``model_dir`` (its ``config.json``), or
    ``[]`` for a text-only model (no ``vision_config``) or a directory without a config."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(cfg, dict) or cfg.get("vision_config") is None:
        return []
    return vision_token_ids(SimpleNamespace(**cfg), tokenizer)

"""Images and text to Qwen2.5-VL / Qwen3-VL model inputs, one sample or a packed micro-batch.

transformers' ``Qwen2_5_VLProcessor`` does this for a batch, but it cannot be built without
torchvision (it requires a video processor, and transformers' Qwen2-VL video processor imports
torchvision, which the CPU environment lacks). What it does for images is small and is done
here the same way: the image processor gives each image's patches (``pixel_values``) and grid
(``image_grid_thw``: temporal, height, width in patches); each ``<|image_pad|>`` placeholder of
the text becomes ``t·h·w / merge_size²`` of them (one per merged patch), in image order; and
``mm_token_type_ids`` marks those tokens (1; text 0), which transformers' model needs to compute
the multimodal positions (without it, it silently uses text positions). transformers'
``Qwen3VLProcessor`` expands images the same way (its videos, with timestamps, are not served).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

__all__ = ["VLSample", "encode_sample", "pack_samples", "load_image_processor"]

IMAGE_TOKEN = "<|image_pad|>"


@dataclass
class VLSample:
    """One sample's model inputs: ``input_ids`` [S]; ``pixel_values`` [patches, C·t·p·p] and
    ``image_grid_thw`` [images, 3] (None without images); ``mm_token_type_ids`` [S]."""

    input_ids: torch.Tensor
    pixel_values: Optional[torch.Tensor]
    image_grid_thw: Optional[torch.Tensor]
    mm_token_type_ids: torch.Tensor


def load_image_processor(model_dir):
    """The image processor saved in ``model_dir`` (``preprocessor_config.json``), as
    transformers' PIL Qwen2-VL image processor (the torchvision one needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil.from_pretrained(model_dir)


def encode_sample(text: str, images: Sequence, tokenizer, image_processor) -> VLSample:
    """``text`` with one ``<|image_pad|>`` per image of ``images`` (PIL images or arrays, in
    order; e.g. a rendered chat template) to a :class:`VLSample`."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 != len(images):
        raise ValueError(
            f"the text has {len(parts) - 1} {IMAGE_TOKEN} placeholders for {len(images)} images"
        )
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if not images:
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        return VLSample(ids, None, None, torch.zeros_like(ids, dtype=torch.int))
    enc = image_processor(images=list(images), return_tensors="pt")
    grid = enc["image_grid_thw"]
    merge = int(image_processor.merge_size) ** 2
    expanded = parts[0] + "".join(
        IMAGE_TOKEN * (int(g.prod()) // merge) + rest for g, rest in zip(grid, parts[1:])
    )
    ids = torch.tensor(tokenizer(expanded)["input_ids"], dtype=torch.long)
    return VLSample(ids, enc["pixel_values"], grid, (ids == image_id).to(torch.int))


def pack_samples(samples: List[VLSample]) -> dict:
    """Samples as one packed (THD) micro-batch: ``input_ids`` [1, T], ``cu_seqlens`` [B+1]
    (int32), the images of all samples in sample order (``pixel_values``, ``image_grid_thw``;
    None without images) and ``mm_token_type_ids`` [1, T]."""
    lens = [len(s.input_ids) for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    with_images = [s for s in samples if s.pixel_values is not None]
    return dict(
        input_ids=torch.cat([s.input_ids for s in samples])[None],
        cu_seqlens=cu,
        pixel_values=torch.cat([s.pixel_values for s in with_images]) if with_images else None,
        image_grid_thw=torch.cat([s.image_grid_thw for s in with_images]) if with_images else None,
        mm_token_type_ids=torch.cat([s.mm_token_type_ids for s in samples])[None],
    )

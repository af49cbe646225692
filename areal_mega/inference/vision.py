"""Images of ``/generate`` requests on the CPU rollout server (Qwen2.5-VL and Qwen3-VL
checkpoints; both through transformers' PIL Qwen2-VL image processor, the one transformers picks
for either without torchvision: 14-pixel patches for Qwen2.5-VL, 16 for Qwen3-VL).

A request carries SGLang's native ``image_data``: one string per image of the prompt, in order
(a ``data:image/...;base64,`` URL, raw base64, or a path readable by the server), and its
``input_ids`` are the processor-expanded prompt: each image is a run of ``t·h·w / merge²``
``<|image_pad|>`` tokens (one per merged patch), as
:func:`areal_mega.models.vlm.inputs.encode_sample` makes them. :class:`VisionInputs` decodes the
images with the checkpoint's own image processor and checks the prompt against them before
anything reaches the engine; each problem is a 400 naming it (an undecodable image, an image of
more than ``max_source_pixels`` pixels, more images than ``max_images``, a placeholder run count
that is not the image count, a run whose length is not its image's token count, video
placeholders, placeholders without ``image_data``).

The model side (positions, the vision tokens never sampled) is
:mod:`areal_mega.inference.vl_model`.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Optional, Sequence

import torch

from areal_mega.data.images import DEFAULT_MAX_IMAGES, BadImage, load_image
from areal_mega.inference.http_api import BadRequest
from areal_mega.inference.vl_model import PromptImages

__all__ = ["VisionInputs", "decode_image_item", "parse_image_data", "placeholder_runs"]

DEFAULT_MAX_SOURCE_PIXELS = 64 * 1024 * 1024


def placeholder_runs(ids: Sequence[int], token_id: int) -> list:
    """Lengths of the maximal runs of ``token_id`` in ``ids``, in order."""
    runs, n = [], 0
    for t in ids:
        if t == token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    return runs


def decode_image_item(item, what: str, max_source_pixels: int):
    """One ``image_data`` entry -> an RGB PIL image: a ``data:image/...;base64,`` URL, a path
    to an existing file, else raw base64 (SGLang's readings of a string); remote URLs are not
    fetched. :class:`BadRequest` naming ``what`` otherwise."""
    if not isinstance(item, str) or not item:
        raise BadRequest(f"{what}: expected a non-empty string, got {type(item).__name__}")
    value: object = item
    if not item.startswith(("data:", "http://", "https://")):
        try:
            is_file = len(item) < 4096 and Path(item.removeprefix("file://")).is_file()
        except (OSError, ValueError):
            is_file = False
        if not is_file:
            try:
                base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(
                    f"{what}: neither a data URL, a file on this server nor base64"
                ) from None
            value = {"base64": item}
    try:
        return load_image(value, base_dir=Path("/"), what=what, max_source_pixels=max_source_pixels)
    except BadImage as e:
        raise BadRequest(str(e)) from None


class VisionInputs:
    """A VL checkpoint's image processor and vision token ids; checks and encodes the
    ``image_data`` of prompts (see the module docstring)."""

    def __init__(
        self,
        model_dir,
        cfg,
        max_images: int = DEFAULT_MAX_IMAGES,
        max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS,
    ):
        from areal_mega.models.vlm.inputs import load_image_processor

        self.processor = load_image_processor(model_dir)
        self.image_token_id = int(cfg.image_token_id)
        self.video_token_id = getattr(cfg, "video_token_id", None)
        self.merge = int(self.processor.merge_size) ** 2
        self.max_images = max_images
        self.max_source_pixels = max_source_pixels

    def check_placeholders(self, ids: Sequence[int], grid: Optional[torch.Tensor], where: str):
        """400 unless ``ids``' ``<|image_pad|>`` runs match the images of ``grid`` (None: no
        images) one to one, in order, and no video placeholder is present."""
        if self.video_token_id is not None and int(self.video_token_id) in ids:
            raise BadRequest(f"{where}: the prompt has <|video_pad|> tokens; videos are not served")
        runs = placeholder_runs(ids, self.image_token_id)
        if grid is None:
            if runs:
                raise BadRequest(
                    f"{where}: the prompt has {sum(runs)} <|image_pad|> tokens but no image_data"
                )
            return
        want = [int(g.prod()) // self.merge for g in grid]
        if sum(runs) != sum(want):
            raise BadRequest(
                f"{where}: {sum(runs)} <|image_pad|> tokens in input_ids, but the images need "
                f"sum(t*h*w)/merge^2 = {sum(want)} ({want} per image; input_ids must be the "
                "processor-expanded prompt)"
            )
        if len(runs) != len(want):
            raise BadRequest(
                f"{where}: {len(want)} image(s) in image_data but {len(runs)} runs of "
                "<|image_pad|> placeholders in input_ids"
            )
        for i, (got, need) in enumerate(zip(runs, want)):
            if got != need:
                raise BadRequest(
                    f"{where}: image {i} needs {need} <|image_pad|> tokens, its run in input_ids "
                    f"has {got}"
                )

    def encode(self, ids: Sequence[int], items: Optional[list], where: str):
        """The prompt's :class:`PromptImages` (None without images), after decoding each item
        and checking ``ids`` against the images (400 naming the problem)."""
        if not items:
            self.check_placeholders(ids, None, where)
            return None
        if len(items) > self.max_images:
            raise BadRequest(
                f"{where}: {len(items)} images, more than {self.max_images} (the server's "
                "--max-images: data.images.max_images)"
            )
        images = [
            decode_image_item(it, f"{where}[{i}]", self.max_source_pixels)
            for i, it in enumerate(items)
        ]
        enc = self.processor(images=images, return_tensors="pt")
        pv, grid = enc["pixel_values"], enc["image_grid_thw"].to(torch.long)
        self.check_placeholders(ids, grid, where)
        return PromptImages(pv, grid, images)


def parse_image_data(body: dict, prompts: list, batched: bool) -> Optional[list]:
    """``/generate``'s ``image_data`` as one list of image strings (or None) per prompt, in
    SGLang's shapes: for one prompt a string or a list of strings; for a batch a list with
    one entry per prompt, each None, a string or a list of strings. None when absent."""
    raw = body.get("image_data")
    if raw is None or raw == []:
        return None
    w = "generate.image_data"
    if not batched:
        per = [raw]
    elif isinstance(raw, list) and len(raw) == len(prompts):
        per = raw
    else:
        raise BadRequest(f"{w}: a batch of {len(prompts)} prompts needs one entry per prompt")
    out = []
    for i, one in enumerate(per):
        if one is None or one == []:
            out.append(None)
        elif isinstance(one, str):
            out.append([one])
        elif isinstance(one, list) and all(isinstance(x, str) for x in one):
            out.append(list(one))
        else:
            where = w if not batched else f"{w}[{i}]"
            raise BadRequest(f"{where}: expected a string or a list of strings")
    return out

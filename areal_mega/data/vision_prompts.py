"""Prompt records with images made model inputs: rendered, checked and tokenized when the
dataset is read, encoded once per drawn prompt.

When the dataset is read (:class:`~areal_mega.data.dataset.PromptDataset`), a record whose
prompt holds images (the formats of :mod:`areal_mega.data.images`) is admitted under the
:class:`~areal_mega.data.images.ImagePolicy` (a bad image stops the run naming the record, or
skips the record and counts it), rendered with the chat template (each image a
``<|vision_start|><|image_pad|><|vision_end|>`` placeholder) and tokenized with each
placeholder expanded to the image's merged patches
(:func:`areal_mega.models.vlm.inputs.encode_sample`), so ``data.max_prompt_len`` counts the
image tokens. The pixels are not kept: :meth:`VisionPrompts.inputs` decodes the images again
when the prompt is drawn, once for all the samples of its group, and gives the expanded ids,
the trainer's ``multimodal`` (``pixel_values`` float32 [patches, patch_dim], ``image_grid_thw``
int32 [images, 3]) and the rollout server's ``image_data`` (the same images as PNG data URLs).

Image sizes: with ``data.images.min_pixels`` / ``max_pixels`` set, each image is resized first,
aspect kept, to sides that are multiples of patch x merge size with an area in those bounds
(transformers' ``smart_resize``, the processor's bicubic filter). The server is sent that
resized image, and the model's processor on either side then leaves its size as it is (or
resizes it the same way on both sides), so the trainer and the server see the same patches.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Optional

import numpy as np

from areal_mega.data.errors import DataError
from areal_mega.data.images import ImagePolicy, prompt_images

__all__ = ["VISION_PLACEHOLDER", "VisionPrompts", "has_images", "png_data_url", "raw_text"]

#: what a chat template renders for one image (Qwen2-VL family); raw text prompts get it too
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


def has_images(prompt: Any, images: Any = None) -> bool:
    """Whether a record's prompt carries images: image / image_url content parts, or
    ``<image>`` markers with the record's ``images`` list."""
    if images:
        return True
    if isinstance(prompt, str):
        return False
    if not isinstance(prompt, list):
        return False
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in content
        ):
            return True
    return False


def png_data_url(img) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (lossless: the server decodes the
    very pixels the trainer's patches came from)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class VisionPrompts:
    """The image side of a prompt dataset: the model's image processor (loaded from
    ``model_dir`` on the first record with images), the size bounds and the bad-image policy.

    Args:
        model_dir: the HF model directory (its ``preprocessor_config.json``); None: a record
            with images is an error.
        min_pixels / max_pixels: resize bounds (``data.images.*``; 0 = the processor's own).
        policy: bad images (default: stop on the first).
        images_key: the record field with the images of ``<image>`` markers.
    """

    def __init__(
        self,
        model_dir: Optional[str] = None,
        *,
        min_pixels: int = 0,
        max_pixels: int = 0,
        policy: Optional[ImagePolicy] = None,
        images_key: str = "images",
    ):
        if min_pixels < 0 or max_pixels < 0:
            raise DataError(
                f"data.images.min_pixels={min_pixels}, data.images.max_pixels={max_pixels}: "
                "must be >= 0"
            )
        if min_pixels and max_pixels and min_pixels > max_pixels:
            raise DataError(
                f"data.images.min_pixels={min_pixels}: must be <= data.images.max_pixels "
                f"({max_pixels})"
            )
        self.model_dir = model_dir
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.policy = policy or ImagePolicy()
        self.images_key = images_key
        self._processor = None

    @classmethod
    def from_config(cls, data_cfg, model_dir: Optional[str]) -> "VisionPrompts":
        """From ``data.images.*`` (:class:`~areal_mega.config.sections.DataImagesConfig`)."""
        im = data_cfg.images
        return cls(
            model_dir,
            min_pixels=im.min_pixels,
            max_pixels=im.max_pixels,
            policy=ImagePolicy(
                max_source_pixels=im.max_source_pixels,
                max_images=im.max_images,
                on_bad=im.on_bad,
            ),
            images_key=im.images_key,
        )

    @property
    def processor(self):
        """The model's image processor (transformers' PIL Qwen2-VL one)."""
        if self._processor is None:
            if self.model_dir is None:
                raise DataError(
                    "a prompt has images but no model directory was given to load the image "
                    "processor from"
                )
            if not (Path(self.model_dir) / "preprocessor_config.json").is_file():
                raise DataError(
                    f"a prompt has images but model.path={self.model_dir!r} has no image "
                    "processor (preprocessor_config.json): is it a vision-language model?"
                )
            from areal_mega.models.vlm.inputs import load_image_processor

            self._processor = load_image_processor(self.model_dir)
        return self._processor

    def record_images(self, row: dict) -> Any:
        """The record's images list (for ``<image>`` markers), or None."""
        return row.get(self.images_key)

    def resize(self, img):
        """``img`` resized into the ``min_pixels`` / ``max_pixels`` bounds (unchanged when
        neither is set, or when it already fits: sides multiples of patch x merge size)."""
        if not (self.min_pixels or self.max_pixels):
            return img
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        proc = self.processor
        size = proc.size
        lo = self.min_pixels or int(size["shortest_edge"])
        hi = self.max_pixels or int(size["longest_edge"])
        width, height = img.size
        factor = int(proc.patch_size) * int(proc.merge_size)
        try:
            h, w = smart_resize(height, width, factor=factor, min_pixels=lo, max_pixels=hi)
        except ValueError as e:  # an extreme aspect ratio
            raise DataError(f"image of {width}x{height} pixels: {e}") from None
        if (w, h) == (width, height):
            return img
        return img.resize((w, h), resample=Image.Resampling.BICUBIC)

    def admit(self, row: dict, prompt: Any, *, base_dir: Path, where: str):
        """(placeholder messages, resized RGB images) of a record, or None when the policy
        skips it (see :class:`~areal_mega.data.images.ImagePolicy`)."""
        got = self.policy.admit(
            prompt, base_dir=base_dir, where=where, images=self.record_images(row)
        )
        if got is None:
            return None
        messages, images = got
        return messages, [self.resize(img) for img in images]

    def encode(self, text: str, images: list, tokenizer, where: str):
        """:func:`~areal_mega.models.vlm.inputs.encode_sample` with a mismatch between
        placeholders and images reported as a :class:`DataError` naming ``where``."""
        from areal_mega.models.vlm.inputs import encode_sample

        try:
            return encode_sample(text, images, tokenizer, self.processor)
        except ValueError as e:
            raise DataError(
                f"{where}: {e} (does the chat template render each image as {IMAGE_PAD}?)"
            ) from None

    def inputs(self, source: dict, tokenizer) -> dict:
        """The model inputs of one drawn prompt from its :attr:`PromptItem.vision` ``source``
        (the record's prompt, images, folder and rendered text): ``input_ids`` (expanded),
        ``multimodal`` and ``image_data`` (see the module docstring)."""
        where = source["where"]
        _, images = prompt_images(
            source["prompt"],
            base_dir=Path(source["base_dir"]),
            where=where,
            images=source.get("images"),
            max_source_pixels=self.policy.max_source_pixels,
            max_images=self.policy.max_images,
        )
        images = [self.resize(img) for img in images]
        vl = self.encode(source["text"], images, tokenizer, where)
        return {
            "input_ids": [int(i) for i in vl.input_ids],
            "multimodal": {
                "pixel_values": np.ascontiguousarray(vl.pixel_values.numpy(), dtype=np.float32),
                "image_grid_thw": np.ascontiguousarray(vl.image_grid_thw.numpy(), dtype=np.int32),
            },
            "image_data": [png_data_url(img) for img in images],
        }


def raw_text(messages: list) -> str:
    """The raw text (no chat template) of placeholder messages: text parts as they are, each
    image as :data:`VISION_PLACEHOLDER` (where its ``<image>`` marker was)."""
    out = []
    for m in messages:
        for part in m["content"]:
            out.append(VISION_PLACEHOLDER if part["type"] == "image" else part["text"])
    return "".join(out)

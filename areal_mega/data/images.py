"""Images in prompt records, read and checked where they enter.

A record's chat prompt carries its images as content parts, in either spelling that
transformers' processors accept::

    {"role": "user", "content": [
        {"type": "image", "image": "imgs/0001.png"},              # or "path" / "url" / "base64"
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO..."}},  # OpenAI
        {"type": "text", "text": "How many shapes are there?"}]}

or, as geometry datasets do, a string prompt with ``<image>`` markers and the record's
``images`` list (one entry per marker, in order). An image value is a path (relative to the
dataset file's folder, or absolute), a ``data:image/...;base64,`` URL, base64 under a part's
``base64`` key, a ``datasets`` Image cell (``{"bytes": ..., "path": ...}``) or a PIL image.
Remote URLs are never fetched (store the images with the dataset).

:func:`prompt_images` turns a prompt into messages whose image parts are ``{"type": "image"}``
placeholders (what a processor's chat template expands) and the decoded RGB images in order.
A bad image (missing file, bytes that do not decode, more than ``max_source_pixels`` pixels, more
than ``max_images`` in one prompt) raises :class:`BadImage`, a :class:`DataError` naming the
record and the part; :class:`ImagePolicy` decides whether the dataset stops on it or skips the
record and counts it.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from areal_mega.data.errors import DataError

IMAGE_MARKER = "<image>"
#: images one prompt may hold by default (``data.images.max_images``; the CPU server's limit)
DEFAULT_MAX_IMAGES = 16
BAD_IMAGE_ACTIONS = ("error", "skip")


class BadImage(DataError):
    """An image of a record that cannot be used; the message names the record and the part."""


@dataclass
class ImagePolicy:
    """How images are admitted: ``on_bad`` is ``error`` (stop, naming the record) or ``skip``
    (drop the record and count it in ``skipped``, with the first few reasons kept)."""

    max_source_pixels: int = 64 * 1024 * 1024
    max_images: int = 16
    on_bad: str = "error"
    skipped: int = 0
    reasons: list = field(default_factory=list)

    def __post_init__(self):
        if self.on_bad not in BAD_IMAGE_ACTIONS:
            raise DataError(f"on_bad={self.on_bad!r}: must be one of {list(BAD_IMAGE_ACTIONS)}")
        if self.max_source_pixels < 1 or self.max_images < 1:
            raise DataError(
                f"max_source_pixels={self.max_source_pixels}, max_images={self.max_images}: "
                "both must be >= 1"
            )

    def admit(self, prompt: Any, *, base_dir: Path, where: str, images: Optional[list] = None):
        """:func:`prompt_images` under this policy: ``None`` for a skipped record."""
        try:
            return prompt_images(
                prompt,
                base_dir=base_dir,
                where=where,
                images=images,
                max_source_pixels=self.max_source_pixels,
                max_images=self.max_images,
            )
        except BadImage as e:
            if self.on_bad == "error":
                raise
            self.skipped += 1
            if len(self.reasons) < 5:
                self.reasons.append(str(e))
            return None


def _check_size(img, what: str, max_source_pixels: int) -> None:
    width, height = img.size
    if width * height > max_source_pixels:
        raise BadImage(
            f"{what}: {width}x{height} = {width * height} pixels, more than max_source_pixels="
            f"{max_source_pixels}"
        )
    if width < 1 or height < 1:
        raise BadImage(f"{what}: empty image ({width}x{height})")


def _decode(data: bytes, what: str, max_source_pixels: int):
    """Decode ``data``; the size is checked from the header, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        _check_size(img, what, max_source_pixels)
        img.load()
    except BadImage:
        raise
    except (
        UnidentifiedImageError,
        Image.DecompressionBombError,
        OSError,
        SyntaxError,
        ValueError,
    ) as e:
        raise BadImage(f"{what}: not a decodable image ({type(e).__name__}: {e})") from None
    return img


def _base64_bytes(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadImage(f"{what}: not valid base64 ({e})") from None


def load_image(value: Any, *, base_dir: Path, what: str, max_source_pixels: int):
    """One image value (see the module docstring) -> an RGB ``PIL.Image``; :class:`BadImage`
    naming ``what`` when it cannot be read or has more than ``max_source_pixels`` pixels."""
    from PIL import Image

    if isinstance(value, Image.Image):
        img = value
    elif isinstance(value, dict) and isinstance(value.get("base64"), str):
        img = _decode(_base64_bytes(value["base64"], what), what, max_source_pixels)
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            img = _decode(bytes(value["bytes"]), what, max_source_pixels)
        else:
            return load_image(
                value["path"], base_dir=base_dir, what=what, max_source_pixels=max_source_pixels
            )
    elif isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise BadImage(f"{what}: remote image URLs are not fetched; store the image locally")
        if value.startswith("data:"):
            head, sep, payload = value.partition(",")
            if not sep or not head.startswith("data:image/") or ";base64" not in head:
                raise BadImage(f"{what}: a data URL must be data:image/<type>;base64,<data>")
            img = _decode(_base64_bytes(payload, what), what, max_source_pixels)
        else:
            path = Path(value.removeprefix("file://"))
            path = path if path.is_absolute() else base_dir / path
            if not path.is_file():
                raise BadImage(f"{what}: image file {str(path)!r} not found")
            img = _decode(path.read_bytes(), f"{what} ({path})", max_source_pixels)
    else:
        raise BadImage(
            f"{what}: an image must be a path, a data URL, base64, a datasets Image cell or a "
            f"PIL image, got {type(value).__name__}"
        )
    _check_size(img, what, max_source_pixels)
    return img.convert("RGB")


def _image_value(part: dict, what: str) -> Any:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if url is None:
            raise BadImage(f"{what}: image_url part without a url")
        return url
    if isinstance(part.get("base64"), str):
        return {"base64": part["base64"]}
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    raise BadImage(f"{what}: image part without one of image / url / path / base64")


def prompt_images(
    prompt: Any,
    *,
    base_dir: Path,
    where: str,
    images: Optional[list] = None,
    max_source_pixels: int = 64 * 1024 * 1024,
    max_images: int = 16,
) -> tuple[list[dict], list]:
    """A record's prompt (messages with image parts, or a string / messages with ``<image>``
    markers and the record's ``images``) -> (messages with ``{"type": "image"}`` placeholder
    parts, the decoded RGB images in the order of their placeholders)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise DataError(f"{where}: prompt must be a string or a list of {{role, content}} messages")
    pending = list(images or [])
    out_messages, out_images = [], []

    def take(value: Any, what: str) -> None:
        if len(out_images) >= max_images:
            raise BadImage(f"{where}: more than max_images={max_images} images in one prompt")
        out_images.append(
            load_image(value, base_dir=base_dir, what=what, max_source_pixels=max_source_pixels)
        )

    for m_i, message in enumerate(messages):
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise DataError(f"{where}: message {m_i} content must be a string or a part list")
        new_parts = []
        for p_i, part in enumerate(parts):
            what = f"{where}: message {m_i} part {p_i}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "image_url"):
                take(_image_value(part, what), what)
                new_parts.append({"type": "image"})
            elif kind == "text":
                pieces = str(part.get("text", "")).split(IMAGE_MARKER)
                for k, piece in enumerate(pieces):
                    if k:
                        if not pending:
                            raise BadImage(f"{what}: an {IMAGE_MARKER} marker without an image")
                        take(pending.pop(0), f"{where}: images[{len(out_images)}]")
                        new_parts.append({"type": "image"})
                    if piece:
                        new_parts.append({"type": "text", "text": piece})
            else:
                raise DataError(f"{what}: unknown content part {part!r:.80}")
        out_messages.append(dict(message, content=new_parts))
    if pending:
        raise BadImage(
            f"{where}: {len(pending)} image(s) in the record's images without an "
            f"{IMAGE_MARKER} marker in the prompt"
        )
    return out_messages, out_images

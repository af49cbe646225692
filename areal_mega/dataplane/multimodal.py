"""A trajectory's images: ``Trajectory.multimodal`` and the checks against the model's vision.

``multimodal`` is empty for a text sample; a sample with images holds exactly

=============== ======== ==================== ==============================================
key             dtype    shape                meaning
=============== ======== ==================== ==============================================
pixel_values    float32  [patches, patch_dim] every image's patches, images in prompt order
image_grid_thw  int32    [images, 3]          each image's grid (temporal, height, width) in
                                              patches; ``sum(t·h·w) == patches``
=============== ======== ==================== ==============================================

as the image processor of a Qwen2-VL family model gives them
(:func:`areal_mega.models.vlm.inputs.encode_sample`), for the images of the sample's prompt.

Two levels of checks, each giving ``(field, problem)`` for the first failure (None when all
hold), which the caller raises as a :class:`~areal_mega.dataplane.trajectory.TrajectoryError`
naming ``multimodal.<key>`` and the sample:

* :func:`multimodal_problem` (run by ``Trajectory.validate``): the arrays on their own: the
  keys, dtypes, 2-D shapes, grid entries >= 1, rows = ``sum(t·h·w)``, finite pixels;
* :func:`vision_problem` (run by the receiver of a model, ``TrajectoryReceiver(vision=...)``):
  against the model's :class:`VisionSpec`, or its absence (a text model refuses images): the
  patch size, the bounds, and the tokens: ``input_ids`` hold exactly ``sum(t·h·w) / merge²``
  image placeholders, all of them on the prompt (``loss_mask`` 0, ``versions`` -1 there). A
  vision-language model accepts text samples (no images, no placeholder).

The worker also keeps the images as its prompt sent them to the rollout servers, in
``Trajectory.meta["image_data"]`` (a list of strings, one per image of ``image_grid_thw`` in
order: ``data:image/...;base64,`` URLs or raw base64), what a served teacher scores the sample
with (:mod:`areal_mega.rollout.scoring`). It is optional; where present
:func:`image_data_problem` (run by :func:`vision_problem`) checks it: a list of one bounded
base64 string (or data URL) per image, and no such list on a sample without images.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = [
    "MULTIMODAL_KEYS",
    "WIRE_PREFIX",
    "VisionSpec",
    "multimodal_problem",
    "vision_problem",
    "image_patches",
    "image_tokens",
    "image_data_problem",
    "MAX_IMAGE_DATA_CHARS",
]

MULTIMODAL_KEYS = {"pixel_values": np.dtype(np.float32), "image_grid_thw": np.dtype(np.int32)}
"""The keys of a non-empty ``Trajectory.multimodal`` with their exact dtypes."""

WIRE_PREFIX = "multimodal."
"""Wire (and ``Trajectory.arrays``) names of the multimodal arrays: ``multimodal.<key>``; no
token extra may start with it."""


@dataclass(frozen=True)
class VisionSpec:
    """What a vision-language model accepts (built from its HF config by
    :func:`areal_mega.models.vlm.config.vision_spec`).

    ``image_token_id``: the ``<|image_pad|>`` placeholder; ``merge_size``: the spatial merge
    (``merge_size²`` patches make one placeholder token); ``patch_dim``: values per patch
    (channels · temporal patch · patch²); ``max_patches`` / ``max_images``: the most one sample
    may carry (bounds on what a receiver holds in memory and the vision tower runs on)."""

    image_token_id: int
    merge_size: int
    patch_dim: int
    max_patches: int
    max_images: int

    def __post_init__(self):
        for name in ("image_token_id", "merge_size", "patch_dim", "max_patches", "max_images"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if "id" in name else 1):
                raise ValueError(f"VisionSpec.{name}={v!r} must be an int >= 1 (ids >= 0)")


MAX_IMAGE_DATA_CHARS = 32 * 1024 * 1024
"""The longest one ``meta["image_data"]`` string may be (a data URL of a ~24 MB image file)."""


def _error(key: str, problem: str) -> tuple:
    return (f"multimodal.{key}" if key else "multimodal", problem)


def image_patches(grid: np.ndarray) -> np.ndarray:
    """Patches of each image, ``t·h·w`` (int64 [images]) of an ``image_grid_thw``."""
    g = np.asarray(grid).astype(np.int64, copy=False)
    return g[:, 0] * g[:, 1] * g[:, 2]


def image_tokens(multimodal: dict, merge_size: int) -> int:
    """Placeholder tokens of the images of ``multimodal``: ``sum(t·h·w) / merge_size²``."""
    if not multimodal:
        return 0
    return int(image_patches(multimodal["image_grid_thw"]).sum()) // (merge_size * merge_size)


def multimodal_problem(mm) -> Optional[tuple]:
    """``(field, problem)`` for the arrays of a ``multimodal`` dict on their own, or None
    (see the module docstring)."""
    if type(mm) is not dict:
        return _error("", f"must be a dict, got {type(mm).__name__}")
    if not mm:
        return None
    if set(mm) != set(MULTIMODAL_KEYS):
        return _error("", f"keys {sorted(mm)}, expected exactly {sorted(MULTIMODAL_KEYS)}")
    for key, dtype in MULTIMODAL_KEYS.items():
        a = mm[key]
        if not isinstance(a, np.ndarray) or a.dtype != dtype:
            return _error(key, f"dtype {getattr(a, 'dtype', type(a).__name__)}, expected {dtype}")
        if a.ndim != 2 or not a.shape[0] or not a.shape[1]:
            return _error(key, f"shape {tuple(a.shape)}, expected a non-empty 2-D array")
    pixels, grid = mm["pixel_values"], mm["image_grid_thw"]
    if grid.shape[1] != 3:
        return _error("image_grid_thw", f"shape {tuple(grid.shape)}, expected (images, 3)")
    if int(grid.min()) < 1:
        return _error("image_grid_thw", f"entry {int(grid.min())} < 1")
    # in float64 first: a forged grid must not wrap around int64 to the right count
    rows = pixels.shape[0]
    if float(np.prod(grid, axis=1, dtype=np.float64).sum()) > rows:
        patches = float(np.prod(grid, axis=1, dtype=np.float64).sum())
    else:
        patches = int(image_patches(grid).sum())
    if patches != rows:
        return _error(
            "pixel_values",
            f"{rows} patch rows, image_grid_thw gives sum(t*h*w) = {patches:.0f}",
        )
    if not (np.isfinite(pixels.max()) and np.isfinite(pixels.min())):
        return _error("pixel_values", "must be finite")
    return None


def image_data_problem(meta: dict, n_images: int) -> Optional[tuple]:
    """``("meta.image_data", problem)`` unless ``meta``'s ``image_data`` (optional) is a list
    of ``n_images`` strings, each a ``data:image/...;base64,`` URL or raw base64 of at most
    :data:`MAX_IMAGE_DATA_CHARS` characters; None when it holds (or is absent)."""
    if "image_data" not in meta:
        return None
    items = meta["image_data"]
    if type(items) is not list:
        return ("meta.image_data", f"must be a list of strings, got {type(items).__name__}")
    if len(items) != n_images:
        return (
            "meta.image_data",
            f"{len(items)} entries for the {n_images} image(s) of image_grid_thw",
        )
    for i, item in enumerate(items):
        if type(item) is not str or not item:
            return ("meta.image_data", f"entry {i} is not a non-empty string")
        if len(item) > MAX_IMAGE_DATA_CHARS:
            return (
                "meta.image_data",
                f"entry {i} has {len(item)} characters > {MAX_IMAGE_DATA_CHARS}",
            )
        payload = item
        if item.startswith("data:"):
            head, sep, payload = item.partition(",")
            if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
                return (
                    "meta.image_data",
                    f"entry {i} is a data URL but not data:image/<type>;base64,<data>",
                )
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            return ("meta.image_data", f"entry {i} is neither a data URL nor base64")
        if not payload:
            return ("meta.image_data", f"entry {i} holds no image bytes")
    return None


def vision_problem(traj, vision: Optional[VisionSpec]) -> Optional[tuple]:
    """``(field, problem)`` for ``traj`` (already validated) against the receiving model's
    ``vision`` (None: a text model, which refuses images), or None; see the module
    docstring."""
    mm = traj.multimodal
    if vision is None:
        if mm or traj.meta.get("image_data"):
            return _error(
                "", "the sample carries images but the model is text-only (no vision tower)"
            )
        return None
    problem = image_data_problem(traj.meta, int(mm["image_grid_thw"].shape[0]) if mm else 0)
    if problem is not None:
        return problem
    ids = traj.input_ids
    at = np.flatnonzero(ids == vision.image_token_id)
    if not mm:
        if at.size:
            return _error(
                "",
                f"input_ids hold {at.size} image placeholders (id {vision.image_token_id}) "
                "but the sample carries no images",
            )
        return None
    pixels, grid = mm["pixel_values"], mm["image_grid_thw"]
    if pixels.shape[1] != vision.patch_dim:
        return _error(
            "pixel_values", f"patch_dim {pixels.shape[1]}, the model's is {vision.patch_dim}"
        )
    if grid.shape[0] > vision.max_images:
        return _error("image_grid_thw", f"{grid.shape[0]} images > max_images={vision.max_images}")
    if pixels.shape[0] > vision.max_patches:
        return _error(
            "pixel_values", f"{pixels.shape[0]} patches > max_patches={vision.max_patches}"
        )
    m = vision.merge_size
    if (grid[:, 1] % m).any() or (grid[:, 2] % m).any():
        return _error(
            "image_grid_thw", f"grid height and width must be multiples of merge_size={m}"
        )
    want = image_tokens(mm, m)
    if at.size != want:
        return _error(
            "",
            f"input_ids hold {at.size} image placeholders (id {vision.image_token_id}), the "
            f"images need sum(t*h*w)/merge_size^2 = {want}",
        )
    if int(at[-1]) >= int(traj.prompt_len):
        return _error("", f"image placeholder at token {int(at[-1])}, after the prompt")
    if traj.loss_mask[at].any() or (traj.versions[at] != -1).any():
        return _error("", "image placeholders need loss_mask 0 and versions -1")
    return None

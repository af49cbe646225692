"""Trajectories with images for data-plane and trainer tests: the layout encode_sample gives
(placeholders expanded to t*h*w/merge^2 per image, inside the prompt), random pixels."""

import numpy as np

from areal_mega.dataplane import Trajectory, VisionSpec

SPEC = VisionSpec(image_token_id=7, merge_size=2, patch_dim=12, max_patches=4096, max_images=8)


def make_vl_traj(
    seed: int,
    grids=((1, 2, 4),),
    *,
    spec: VisionSpec = SPEC,
    n_completion: int = 5,
    sample_id=None,
    group_id: str = "g",
    reward: float = 0.0,
    pixels=None,
) -> Trajectory:
    """A sample whose prompt is ``[vision_start, placeholders..., vision_end]`` per image of
    ``grids`` (t, h, w) then a little text; ``pixels``: the pixel_values (random by default)."""
    rng = np.random.default_rng(seed)
    m2 = spec.merge_size**2
    prompt = [1]
    for t, h, w in grids:
        prompt += [2] + [spec.image_token_id] * (t * h * w // m2) + [3]
    prompt += [int(x) for x in rng.integers(10, 30, 3)]
    completion = rng.integers(10, 30, n_completion)
    mm = {}
    if grids:
        n_patches = sum(t * h * w for t, h, w in grids)
        mm = {
            "pixel_values": (
                rng.standard_normal((n_patches, spec.patch_dim)).astype(np.float32)
                if pixels is None
                else pixels
            ),
            "image_grid_thw": np.asarray(grids, np.int32),
        }
    return Trajectory.from_tokens(
        prompt,
        completion,
        -rng.random(n_completion).astype(np.float32),
        np.zeros(n_completion, np.int32),
        reward=reward,
        sample_id=sample_id or f"vl-{seed}",
        group_id=group_id,
        created_at=1000.0 + seed,
        multimodal=mm,
    )

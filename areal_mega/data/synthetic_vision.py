"""Synthetic visual tasks, drawn here: images with a verifiable answer, written as a dataset of
chat prompts with image parts (the format :mod:`areal_mega.data.images` reads).

- ``count``: 1..``max_count`` filled shapes (squares, discs, triangles) in distinct colours on
  a plain background, one per cell of a grid so that they never touch; the answer is how many
  (``"3"``).
- ``colour``: one shape; the answer is its colour's name (``"red"``).

    python -m areal_mega.data.synthetic_vision --out data/shapes --task count --n-train 2048

writes ``train.jsonl``, ``test.jsonl`` and ``images/*.png``; every record is
``{"prompt": [{"role": "user", "content": [{"type": "image", "image": "images/..."},
{"type": "text", "text": QUESTION}]}], "answer": ..., "task": ...}``. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import numpy as np

from areal_mega.common.files import atomic_write
from areal_mega.data.synthetic import write_jsonl

TASKS = ("count", "colour")
SHAPES = ("square", "disc", "triangle")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
}
BACKGROUND = (255, 255, 255)
QUESTIONS = {"count": "How many shapes?", "colour": "What colour is the shape?"}


def draw_shape(img: np.ndarray, shape: str, top: int, left: int, size: int, rgb) -> None:
    """Fill ``shape`` inside the ``size`` x ``size`` box at (``top``, ``left``) of the
    ``[H, W, 3]`` uint8 ``img`` with colour ``rgb``."""
    yy, xx = np.mgrid[0:size, 0:size]
    if shape == "square":
        mask = np.ones((size, size), dtype=bool)
    elif shape == "disc":
        c = (size - 1) / 2
        mask = (yy - c) ** 2 + (xx - c) ** 2 <= (size / 2) ** 2
    elif shape == "triangle":
        mask = np.abs(xx - (size - 1) / 2) <= yy / 2 + 0.5
    else:
        raise ValueError(f"shape={shape!r}: must be one of {SHAPES}")
    img[top : top + size, left : left + size][mask] = rgb


def make_image(task: str, rng: random.Random, *, size: int = 56, max_count: int = 4):
    """One ``(image [size, size, 3] uint8, answer)`` of ``task``."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}: must be one of {TASKS}")
    grid = 2 if max_count <= 4 else 3
    if max_count > grid * grid:
        raise ValueError(f"max_count={max_count}: at most {grid * grid}")
    cell = size // grid
    if cell < 8:
        raise ValueError(f"size={size}: too small for a {grid}x{grid} grid of shapes")
    img = np.full((size, size, 3), BACKGROUND, dtype=np.uint8)
    n = rng.randint(1, max_count) if task == "count" else 1
    cells = rng.sample(range(grid * grid), n)
    names = rng.sample(sorted(COLOURS), n)
    for k, name in zip(cells, names):
        side = rng.randint(cell // 2, cell - 2)
        top = (k // grid) * cell + rng.randint(1, cell - side - 1)
        left = (k % grid) * cell + rng.randint(1, cell - side - 1)
        draw_shape(img, rng.choice(SHAPES), top, left, side, COLOURS[name])
    return img, (str(n) if task == "count" else names[0])


def write_task(
    out: str | Path,
    task: str,
    *,
    n_train: int,
    n_test: int,
    seed: int = 0,
    size: int = 56,
    max_count: int = 4,
    question: str | None = None,
) -> Path:
    """Write ``train.jsonl``, ``test.jsonl`` and ``images/`` of ``task`` under ``out``."""
    from PIL import Image

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{task}-{seed}")
    text = question or QUESTIONS[task]
    for split, n in (("train", n_train), ("test", n_test)):
        records = []
        for i in range(n):
            img, answer = make_image(task, rng, size=size, max_count=max_count)
            rel = f"images/{split}-{i:05d}.png"
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            atomic_write(out / rel, buf.getvalue(), durable=False)
            content = [{"type": "image", "image": rel}, {"type": "text", "text": text}]
            records.append(
                {"prompt": [{"role": "user", "content": content}], "answer": answer, "task": task}
            )
        write_jsonl(out / f"{split}.jsonl", records)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--task", choices=TASKS, default="count")
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--n-test", type=int, default=128)
    p.add_argument("--size", type=int, default=56, help="image side in pixels")
    p.add_argument("--max-count", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    path = write_task(
        a.out,
        a.task,
        n_train=a.n_train,
        n_test=a.n_test,
        seed=a.seed,
        size=a.size,
        max_count=a.max_count,
    )
    print(f"wrote {a.n_train} train / {a.n_test} test {a.task} records to {path}")


if __name__ == "__main__":
    main()

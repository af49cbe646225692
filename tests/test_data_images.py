"""Images in prompt records (areal_mega.data.images) and the synthetic visual tasks
(areal_mega.data.synthetic_vision): every image spelling read, every bad image named, the drawn
answers true of the drawn pixels."""

import base64
import io
import json
import random
from collections import deque

import numpy as np
import pytest
from PIL import Image

from areal_mega.data.errors import DataError
from areal_mega.data.images import BadImage, ImagePolicy, load_image, prompt_images
from areal_mega.data.synthetic_vision import COLOURS, make_image, write_task

BIG = 1 << 30


def _png(rgb=(10, 200, 30), size=(5, 3)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="PNG")
    return buf.getvalue()


def test_every_image_spelling_reads_the_same_pixels(tmp_path):
    data = _png()
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    values = [
        "imgs/a.png",
        str(tmp_path / "imgs" / "a.png"),
        "file://" + str(tmp_path / "imgs" / "a.png"),
        "data:image/png;base64," + b64,
        {"base64": b64},
        {"bytes": data, "path": None},
        {"bytes": None, "path": "imgs/a.png"},
        Image.open(io.BytesIO(data)).convert("L"),
    ]
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for value in values:
        img = load_image(value, base_dir=tmp_path, what="rec", max_source_pixels=BIG)
        assert img.mode == "RGB" and img.size == (5, 3)
        if not isinstance(value, Image.Image):
            assert np.array_equal(np.asarray(img), want), value


def test_prompt_parts_and_markers_become_placeholders_in_order(tmp_path):
    red, blue, green = _png((255, 0, 0)), _png((0, 0, 255)), _png((0, 255, 0))
    (tmp_path / "r.png").write_bytes(red)
    prompt = [
        {"role": "system", "content": "count"},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "r.png"},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(blue).decode()
                    },
                },
                {"type": "text", "text": "and <image> here"},
            ],
        },
    ]
    messages, images = prompt_images(
        prompt, base_dir=tmp_path, where="f.jsonl:1", images=[{"bytes": green}]
    )
    assert [img.getpixel((0, 0)) for img in images] == [(255, 0, 0), (0, 0, 255), (0, 255, 0)]
    assert messages[0] == {"role": "system", "content": [{"type": "text", "text": "count"}]}
    assert messages[1]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "and "},
        {"type": "image"},
        {"type": "text", "text": " here"},
    ]
    # geometry-dataset style: a string prompt with markers and the record's images
    messages, images = prompt_images(
        "<image>Find x.", base_dir=tmp_path, where="w", images=["r.png"]
    )
    assert messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}
    ]
    assert len(images) == 1


@pytest.mark.parametrize(
    "value, match",
    [
        ("missing.png", "image file .*missing.png' not found"),
        ({"bytes": b"not an image at all"}, "not a decodable image"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "data URL must be data:image"),
        ("https://example.com/a.png", "remote image URLs are not fetched"),
        (42, "an image must be a path"),
    ],
)
def test_bad_images_are_named(tmp_path, value, match):
    with pytest.raises(BadImage, match=match) as e:
        prompt_images(
            [{"role": "user", "content": [{"type": "image", "image": value}]}],
            base_dir=tmp_path,
            where="train.jsonl:7",
        )
    assert "train.jsonl:7: message 0 part 0" in str(e.value)


def test_truncated_file_too_many_pixels_too_many_images_and_unmatched_markers(tmp_path):
    (tmp_path / "cut.png").write_bytes(_png(size=(64, 64))[:40])
    with pytest.raises(BadImage, match="cut.png.*not a decodable image"):
        load_image("cut.png", base_dir=tmp_path, what="r", max_source_pixels=BIG)
    with pytest.raises(BadImage, match=r"5x3 = 15 pixels, more than max_source_pixels=14"):
        load_image({"bytes": _png()}, base_dir=tmp_path, what="r", max_source_pixels=14)
    parts = [{"type": "image", "image": {"bytes": _png()}}] * 3
    with pytest.raises(BadImage, match="more than max_images=2"):
        prompt_images(
            [{"role": "user", "content": parts}], base_dir=tmp_path, where="r", max_images=2
        )
    with pytest.raises(BadImage, match="marker without an image"):
        prompt_images("<image><image>", base_dir=tmp_path, where="r", images=[{"bytes": _png()}])
    with pytest.raises(BadImage, match="1 image.* without an <image> marker"):
        prompt_images("no marker", base_dir=tmp_path, where="r", images=[{"bytes": _png()}])
    with pytest.raises(DataError, match="unknown content part"):
        prompt_images(
            [{"role": "user", "content": [{"type": "audio"}]}], base_dir=tmp_path, where="r"
        )


def test_policy_skips_and_counts_or_stops(tmp_path):
    bad = [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]}]
    good = [{"role": "user", "content": [{"type": "image", "image": {"bytes": _png()}}]}]
    skip = ImagePolicy(on_bad="skip")
    assert skip.admit(bad, base_dir=tmp_path, where="d:1") is None
    assert skip.admit(good, base_dir=tmp_path, where="d:2") is not None
    assert skip.skipped == 1 and "d:1" in skip.reasons[0] and "gone.png" in skip.reasons[0]
    with pytest.raises(BadImage, match="d:3"):
        ImagePolicy().admit(bad, base_dir=tmp_path, where="d:3")
    with pytest.raises(DataError, match="on_bad='drop'"):
        ImagePolicy(on_bad="drop")


def _components(img: np.ndarray) -> int:
    """Connected regions of non-background pixels (4-neighbour flood fill)."""
    fg = (img != 255).any(axis=2)
    seen = np.zeros_like(fg)
    n = 0
    for start in zip(*np.nonzero(fg)):
        if seen[start]:
            continue
        n += 1
        queue = deque([start])
        seen[start] = True
        while queue:
            y, x = queue.popleft()
            for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                q = (y + dy, x + dx)
                if 0 <= q[0] < fg.shape[0] and 0 <= q[1] < fg.shape[1] and fg[q] and not seen[q]:
                    seen[q] = True
                    queue.append(q)
    return n


def test_drawn_answers_are_true_of_the_pixels():
    rng = random.Random(3)
    counts = []
    for _ in range(60):
        img, answer = make_image("count", rng, size=56, max_count=4)
        assert img.shape == (56, 56, 3) and img.dtype == np.uint8
        assert _components(img) == int(answer)
        counts.append(int(answer))
    assert set(counts) == {1, 2, 3, 4}
    for _ in range(30):
        img, answer = make_image("colour", rng)
        colours = {tuple(p) for p in img.reshape(-1, 3)} - {(255, 255, 255)}
        assert colours == {COLOURS[answer]}


def test_written_task_reads_back_through_the_image_loader(tmp_path):
    out = write_task(tmp_path / "shapes", "count", n_train=6, n_test=2, seed=1)
    again = write_task(tmp_path / "again", "count", n_train=6, n_test=2, seed=1)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert (out / "train.jsonl").read_text() == (again / "train.jsonl").read_text()
    for row in rows:
        messages, images = prompt_images(row["prompt"], base_dir=out, where="x")
        assert messages[0]["content"] == [
            {"type": "image"},
            {"type": "text", "text": "How many shapes?"},
        ]
        assert _components(np.asarray(images[0])) == int(row["answer"])

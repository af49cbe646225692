"""Prompts with images through the dataset and the workflow items (areal_mega.data.vision_prompts,
PromptDataset with images, data.images.* config): rendered with the chat template, expanded to
the image tokens, encoded once per drawn prompt into the trainer's multimodal and the server's
image_data (the same pixels), bad images under the policy, the size bounds."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from areal_mega.common.errors import ConfigError
from areal_mega.config import load_config
from areal_mega.data.dataset import PromptDataset, load_tokenizer
from areal_mega.data.errors import DataError
from areal_mega.data.images import BadImage, ImagePolicy
from areal_mega.data.synthetic_vision import write_task
from areal_mega.data.vision_prompts import VISION_PLACEHOLDER, VisionPrompts
from areal_mega.models.tiny import make_tiny_model
from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
from areal_mega.workflow.builtin import image_inputs
from areal_mega.workflow.tokens import prompt_ids


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("vl") / "hf", arch="qwen2_5_vl")


@pytest.fixture(scope="module")
def tok(vl_dir):
    return load_tokenizer(str(vl_dir))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("shapes"), "count", n_train=6, n_test=2, seed=1)


def _png(rgb, size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="PNG")
    return buf.getvalue()


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_image_prompt_is_rendered_expanded_and_encoded_once(vl_dir, tok, shapes):
    ds = PromptDataset(shapes / "train.jsonl", tok, vision=VisionPrompts(str(vl_dir)))
    assert len(ds) == 6
    proc = load_image_processor(vl_dir)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    for i in range(len(ds)):
        it = ds[i]
        assert it.prompt == VISION_PLACEHOLDER + "How many shapes?"  # the chat template's
        record = json.loads((shapes / "train.jsonl").read_text().splitlines()[i])
        img = Image.open(shapes / record["prompt"][0]["content"][0]["image"]).convert("RGB")
        ref = encode_sample(it.prompt, [img], tok, proc)
        assert it.input_ids == ref.input_ids.tolist()
        assert it.input_ids.count(pad) == int(ref.image_grid_thw.prod()) // 4 > 1
        f = ds.prompt_fields(i)
        assert f["input_ids"] == it.input_ids and f["answer"] == record["answer"]
        assert f["task"] == "count"
        mm = f["multimodal"]
        assert set(mm) == {"pixel_values", "image_grid_thw"}
        assert mm["pixel_values"].dtype == np.float32 and mm["image_grid_thw"].dtype == np.int32
        np.testing.assert_array_equal(mm["pixel_values"], ref.pixel_values.numpy())
        np.testing.assert_array_equal(mm["image_grid_thw"], ref.image_grid_thw.numpy())
        # the server's image is the same pixels, losslessly
        (url,) = f["image_data"]
        assert url.startswith("data:image/png;base64,")
        sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        np.testing.assert_array_equal(np.asarray(sent), np.asarray(img))
        # what a workflow sends and keeps
        gen, traj = image_inputs(f)
        assert gen == {"image_data": [url]} and traj == {"multimodal": mm}
        assert prompt_ids(tok, f) == it.input_ids


def test_text_prompts_are_unchanged_beside_image_prompts(vl_dir, tok, tmp_path):
    (tmp_path / "a.png").write_bytes(_png((200, 10, 10), (40, 30)))
    path = _write(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "Two plus two?", "answer": "4", "source": "math"},
            {"prompt": "<image>What colour?", "images": ["a.png"], "answer": "red"},
        ],
    )
    ds = PromptDataset(path, tok, vision=VisionPrompts(str(vl_dir)))
    text = ds.prompt_fields(0)
    assert ds[0].vision is None and "multimodal" not in text and "image_data" not in text
    assert text["input_ids"] == tok("Two plus two?", add_special_tokens=False)["input_ids"]
    assert text["source"] == "math"
    assert image_inputs(text) == ({}, {})
    img = ds.prompt_fields(1)
    assert ds[1].prompt == VISION_PLACEHOLDER + "What colour?"
    assert len(img["image_data"]) == 1 and img["multimodal"]["image_grid_thw"].shape == (1, 3)
    # raw text: the <image> marker becomes the placeholder where it stood
    raw = PromptDataset(path, tok, apply_chat_template=False, vision=VisionPrompts(str(vl_dir)))
    assert raw[1].prompt == VISION_PLACEHOLDER + "What colour?"


def test_max_prompt_len_counts_the_image_tokens(vl_dir, tok, shapes):
    full = PromptDataset(shapes / "train.jsonl", tok, vision=VisionPrompts(str(vl_dir)))
    n = min(len(it.input_ids) for it in full.items)
    text_only = len(tok(full[0].prompt, add_special_tokens=False)["input_ids"])
    assert n > text_only
    ds = PromptDataset(
        shapes / "train.jsonl", tok, max_prompt_len=n, vision=VisionPrompts(str(vl_dir))
    )
    assert all(len(it.input_ids) <= n for it in ds.items)
    assert ds.n_dropped == sum(len(it.input_ids) > n for it in full.items)


def test_pixel_bounds_resize_before_the_processor(vl_dir, tok, tmp_path):
    (tmp_path / "big.png").write_bytes(_png((10, 200, 10), (112, 56)))
    path = _write(
        tmp_path / "one.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": [{"type": "image", "image": "big.png"}]}],
                "answer": "green",
            }
        ],
    )
    own = PromptDataset(path, tok, vision=VisionPrompts(str(vl_dir))).prompt_fields(0)
    # the tiny processor keeps at most 56*56 pixels: the 112x56 image becomes 56x28 (2x4 patches)
    assert own["multimodal"]["image_grid_thw"].tolist() == [[1, 2, 4]]
    small = PromptDataset(
        path, tok, vision=VisionPrompts(str(vl_dir), max_pixels=28 * 28)
    ).prompt_fields(0)
    assert small["multimodal"]["image_grid_thw"].tolist() == [[1, 2, 2]]
    grid = small["multimodal"]["image_grid_thw"][0]
    sent = Image.open(io.BytesIO(base64.b64decode(small["image_data"][0].split(",", 1)[1])))
    assert sent.size == (28, 28)  # the server is sent the resized image
    # the model's processor leaves the resized image as it is: the server sees the same patches
    ref = encode_sample(VISION_PLACEHOLDER, [sent], tok, load_image_processor(vl_dir))
    np.testing.assert_array_equal(small["multimodal"]["pixel_values"], ref.pixel_values.numpy())
    assert (
        small["input_ids"].count(tok.convert_tokens_to_ids("<|image_pad|>"))
        == int(grid.prod()) // 4
    )


def test_bad_images_follow_the_policy(vl_dir, tok, tmp_path):
    (tmp_path / "ok.png").write_bytes(_png((1, 2, 3), (28, 28)))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    records = [
        {"prompt": "<image>a", "images": ["ok.png"], "answer": "1"},
        {"prompt": "<image>b", "images": ["missing.png"], "answer": "2"},
        {"prompt": "<image>c", "images": ["broken.png"], "answer": "3"},
    ]
    path = _write(tmp_path / "bad.jsonl", records)
    with pytest.raises(BadImage, match=r"bad.jsonl:2: .*missing.png.* not found"):
        PromptDataset(path, tok, vision=VisionPrompts(str(vl_dir)))
    ds = PromptDataset(
        path, tok, vision=VisionPrompts(str(vl_dir), policy=ImagePolicy(on_bad="skip"))
    )
    assert len(ds) == 1 and ds[0].answer == "1"
    assert ds.n_bad_images == 2 and ds.n_total == 3
    assert "not a decodable image" in ds.vision.policy.reasons[1]
    only_bad = _write(tmp_path / "all_bad.jsonl", records[1:])
    with pytest.raises(DataError, match="no usable prompts .* 2 with a bad image"):
        PromptDataset(
            only_bad, tok, vision=VisionPrompts(str(vl_dir), policy=ImagePolicy(on_bad="skip"))
        )


def test_images_without_an_image_processor_are_a_clear_error(tok, tmp_path):
    (tmp_path / "a.png").write_bytes(_png((1, 2, 3), (28, 28)))
    path = _write(tmp_path / "d.jsonl", [{"prompt": "<image>x", "images": ["a.png"], "answer": 1}])
    with pytest.raises(DataError, match="no model directory"):
        PromptDataset(path, tok)
    with pytest.raises(DataError, match=r"model.path=.* no image processor"):
        PromptDataset(path, tok, vision=VisionPrompts(str(tmp_path)))


def test_a_template_without_image_placeholders_is_named(vl_dir, tmp_path):
    tok = load_tokenizer(str(vl_dir))
    tok.chat_template = "{% for m in messages %}{{ m['content'][-1]['text'] }}{% endfor %}"
    (tmp_path / "a.png").write_bytes(_png((1, 2, 3), (28, 28)))
    path = _write(tmp_path / "d.jsonl", [{"prompt": "<image>x", "images": ["a.png"], "answer": 1}])
    with pytest.raises(DataError, match=r"d.jsonl:1: the text has 0 .* for 1 images"):
        PromptDataset(path, tok, vision=VisionPrompts(str(vl_dir)))


def test_prompt_item_with_images_needs_expanded_ids(tok):
    with pytest.raises(ValueError, match="image-expanded input_ids"):
        prompt_ids(tok, {"prompt": "x", "image_data": ["data:image/png;base64,AA=="]})
    with pytest.raises(ValueError, match="needs its multimodal"):
        image_inputs({"input_ids": [1], "image_data": ["data:image/png;base64,AA=="]})


def test_data_images_config_keys(vl_dir, shapes, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {vl_dir}}}\ndata: {{train_path: {shapes}/train.jsonl}}\n")
    cfg = load_config(
        str(recipe), ["data.images.on_bad=skip", "data.images.max_pixels=784", "seed=3"]
    )
    vision = VisionPrompts.from_config(cfg.data, cfg.model.path)
    assert vision.policy.on_bad == "skip" and vision.max_pixels == 784
    ds = PromptDataset.from_config(cfg.data, load_tokenizer(cfg.model.path), model_dir=str(vl_dir))
    assert all(
        ds.prompt_fields(i)["multimodal"]["image_grid_thw"].tolist() == [[1, 2, 2]]
        for i in range(len(ds))
    )
    for bad, msg in (
        (["data.images.on_bad=drop"], r"data.images.on_bad='drop': must be one of"),
        (["data.images.max_pixels=-1"], r"data.images.max_pixels=-1: must be >= 0"),
        (
            ["data.images.min_pixels=5000", "data.images.max_pixels=3136"],
            r"data.images.min_pixels=5000: must be <= data.images.max_pixels \(3136\)",
        ),
        (["data.images.pixels=1"], r"data.images.pixels: unknown key"),
    ):
        with pytest.raises(ConfigError, match=msg):
            load_config(str(recipe), bad)


def test_pack_of_two_items_matches_their_own_images(vl_dir, tok, shapes):
    """Two drawn prompts' multimodal in sample order is what pack_samples gives (what the
    trainer's micro-batch carries)."""
    from areal_mega.models.vlm.inputs import VLSample, pack_samples

    ds = PromptDataset(shapes / "train.jsonl", tok, vision=VisionPrompts(str(vl_dir)))
    fields = [ds.prompt_fields(i) for i in (0, 1)]
    samples = [
        VLSample(
            torch.tensor(f["input_ids"]),
            torch.from_numpy(f["multimodal"]["pixel_values"]),
            torch.from_numpy(f["multimodal"]["image_grid_thw"]).long(),
            torch.zeros(len(f["input_ids"]), dtype=torch.int),
        )
        for f in fields
    ]
    packed = pack_samples(samples)
    n_pad = int((packed["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert n_pad == int(packed["image_grid_thw"].prod(-1).sum()) // 4
    assert packed["pixel_values"].shape[0] == int(packed["image_grid_thw"].prod(-1).sum())

"""SFT of a vision-language model on image records (areal_mega/train/sft.py): the samples of a
synthetic image dataset (expanded prompts, each record's own patches and grid), the packed
micro-batches carrying their samples' images in packed order, bad images stopped or skipped by
name, and the production path end to end: ``areal_mega.trainer mode=sft`` on the tiny
Qwen2.5-VL converts the HF model, trains on the images through MegatronEngine (the vision tower
gets gradients only from pixels) and exports an HF directory transformers loads."""

import json
import os
import subprocess
import sys

import pytest
import torch

from areal_mega.common.net import free_port
from areal_mega.config import load_config
from areal_mega.data.errors import DataError
from areal_mega.data.synthetic_vision import write_task
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.workers import ROOT

RECIPE = ROOT / "recipes" / "tiny-vl-cpu.yaml"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("vlsft") / "model",
        arch="qwen2_5_vl",
        charset="ascii",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("vlsft_data"), "count", n_train=24, n_test=4)


def _data_cfg(data, *over):
    return load_config(RECIPE, [f"data.train_path={data / 'train.jsonl'}", *over]).data


def test_samples_have_expanded_prompts_and_their_own_images(model, data):
    from transformers import AutoTokenizer

    from areal_mega.train.sft import sft_samples

    tok = AutoTokenizer.from_pretrained(model)
    cfg = json.loads((model / "config.json").read_text())
    samples, images = sft_samples(_data_cfg(data), tok, str(model))
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    assert len(samples) == len(images) == len(rows) == 24
    question = tok("How many shapes?", add_special_tokens=False)["input_ids"]
    for s, (pv, grid), row in zip(samples, images, rows):
        ids = s["input_ids"].tolist()
        prompt = ids[: s["prompt_len"]]
        # 56x56 pixels: a 4x4 patch grid, merged 2x2 into 4 image tokens
        assert grid.tolist() == [[1, 4, 4]] and tuple(pv.shape) == (16, 3 * 2 * 14 * 14)
        assert prompt.count(cfg["image_token_id"]) == 4
        assert prompt[0] == cfg["vision_start_token_id"] and prompt[5] == cfg["vision_end_token_id"]
        assert prompt[6:] == question
        answer = tok(row["answer"], add_special_tokens=False)["input_ids"]
        assert ids[s["prompt_len"] :] == answer + [tok.eos_token_id]
        # next-token layout: the loss is on the positions predicting the answer and EOS
        assert s["loss_mask"].tolist() == [0] * (s["prompt_len"] - 1) + [1] * (len(answer) + 1) + [
            0
        ]
    # every record's own pixels (the pictures differ)
    assert not torch.equal(images[0][0], images[1][0])
    # the micro-batch budget counts the vision tower's work: one token per merged patch
    assert images.image_tokens == [4] * 24


def test_micro_batches_carry_their_samples_images_in_packed_order(model, data):
    from transformers import AutoTokenizer

    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.sft import sft_samples, with_images

    tok = AutoTokenizer.from_pretrained(model)
    samples, images = sft_samples(_data_cfg(data), tok, str(model))
    order = [5, 2, 9]
    mb = with_images(pack_sequences([samples[i] for i in order]), [images[i] for i in order])
    assert torch.equal(mb["pixel_values"], torch.cat([images[i][0] for i in order]))
    assert mb["image_grid_thw"].tolist() == [[1, 4, 4]] * 3
    # a micro-batch of text-only samples carries no images
    text_only = with_images(pack_sequences([samples[0]]), [(None, None)])
    assert text_only["pixel_values"] is None and text_only["image_grid_thw"] is None


def test_bad_image_stops_by_name_or_is_skipped_and_counted(model, data, tmp_path):
    from transformers import AutoTokenizer

    from areal_mega.train.sft import sft_samples

    rows = (data / "train.jsonl").read_text().splitlines()[:3]
    bad = json.loads(rows[1])
    bad["prompt"][0]["content"][0]["image"] = "images/missing.png"
    (tmp_path / "images").symlink_to(data / "images")
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([rows[0], json.dumps(bad), rows[2]]) + "\n")
    tok = AutoTokenizer.from_pretrained(model)
    with pytest.raises(DataError, match="missing.png"):
        sft_samples(_data_cfg(data, f"data.train_path={path}"), tok, str(model))
    cfg = _data_cfg(data, f"data.train_path={path}", "data.images.on_bad=skip")
    samples, images = sft_samples(cfg, tok, str(model))
    assert len(samples) == len(images) == 2
    assert images.data.n_bad_images == 1
    # the expanded prompt (22 tokens: 6 vision, 16 text) counts against data.max_prompt_len
    with pytest.raises(DataError, match="no usable prompts"):
        sft_samples(_data_cfg(data, "data.max_prompt_len=21"), tok, str(model))


def test_trainer_sft_trains_on_the_images_and_exports_an_hf_model(model, data, tmp_path):
    """``areal_mega.trainer mode=sft`` on image records: the HF model is converted, trained
    (the vision tower's patch embedding moves: its gradient comes from the pixels alone) and
    exported; transformers loads the export and its logits on an image prompt differ from the
    base model's."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from areal_mega.data.images import prompt_images
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor

    run = tmp_path / "sft"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.trainer",
            "--config",
            str(RECIPE),
            "mode=sft",
            f"model.path={model}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.test_path={data / 'test.jsonl'}",
            f"logging.run_dir={run}",
            "total_steps=2",
            "data.sft_batch_size=8",
            "optimizer.lr=1e-2",
            "optimizer.warmup_steps=0",
            "recover=off",
            "logging.progress_bar=false",
            "logging.plot=false",
            "checkpoint.save_every=0",
        ],
        cwd=ROOT,
        # a free port: another test's trainer may hold the default one at the same time
        env=dict(
            os.environ,
            CUDA_VISIBLE_DEVICES="",
            PYTHONUNBUFFERED="1",
            MASTER_PORT=str(free_port()),
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("step", 0) >= 1 and "loss" in r]
    assert len(losses) == 2 and all(x == x and x > 0 for x in losses)
    out = run / "hf_model"
    assert (out / "preprocessor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    before = load_file(str(model / "model.safetensors"))
    # the export writes one shard per pipeline stage and an index (train/weights.py)
    assert (out / "model.safetensors.index.json").is_file()
    after = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert sorted(before) == sorted(after)
    patch = "visual.patch_embed.proj.weight"
    assert patch in after and not torch.equal(before[patch], after[patch])

    tok = AutoTokenizer.from_pretrained(out)
    row = json.loads((data / "test.jsonl").read_text().splitlines()[0])
    messages, imgs = prompt_images(row["prompt"], base_dir=data, where="test")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    s = encode_sample(text, imgs, tok, load_image_processor(out))
    logits = []
    for d in (model, out):
        m = Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(
                m(
                    input_ids=s.input_ids[None],
                    pixel_values=s.pixel_values,
                    image_grid_thw=s.image_grid_thw,
                    mm_token_type_ids=s.mm_token_type_ids[None],
                ).logits
            )
    assert torch.isfinite(logits[1]).all() and not torch.allclose(logits[0], logits[1])

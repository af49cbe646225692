"""``python -m areal_mega.eval`` on a dataset with images (a tiny Qwen2.5-VL, CPU rollout servers
sent the images as ``image_data``): at temperature 0 it reproduces transformers' greedy decoding
of the same prompts and images exactly; a bad image stops it naming the record, or is skipped."""

import json

import pytest
import torch
from PIL import Image

from areal_mega.data.synthetic_vision import write_task
from areal_mega.eval.__main__ import cli as eval_cli
from areal_mega.eval.__main__ import main as eval_main
from areal_mega.models.tiny import make_tiny_model
from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
from areal_mega.rewards import load_reward_fn

REWARD = "areal_mega.rewards:exact_match_reward"
MAX_NEW = 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl_eval")
    # initializer_range 0.2: outputs that differ with the image (0.02's are one token repeated)
    model = make_tiny_model(d / "model", arch="qwen2_5_vl", seed=5, initializer_range=0.2)
    data = write_task(d / "shapes", "count", n_train=1, n_test=4, seed=2)
    # a second file: images of other sizes (other grids) behind <image> markers
    for i, size in enumerate([(28, 28), (56, 28), (40, 52)]):
        Image.new("RGB", size, (30 * i, 200, 90)).save(d / "shapes" / f"extra{i}.png")
    extra = d / "shapes" / "extra.jsonl"
    extra.write_text(
        "".join(
            json.dumps({"prompt": f"<image>shape {i}?", "images": [f"extra{i}.png"], "answer": "1"})
            + "\n"
            for i in range(3)
        )
    )
    return model, data / "test.jsonl", extra


def _images_of(record: dict, base) -> tuple:
    """(placeholder messages, images) as the workflow renders them, read independently."""
    if "images" in record:
        text = record["prompt"].replace("<image>", "")
        content = [{"type": "image"}, {"type": "text", "text": text}]
        return [{"role": "user", "content": content}], [
            Image.open(base / p).convert("RGB") for p in record["images"]
        ]
    msgs, images = [], []
    for m in record["prompt"]:
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                images.append(Image.open(base / p["image"]).convert("RGB"))
                parts.append({"type": "image"})
            else:
                parts.append(p)
        msgs.append({"role": m["role"], "content": parts})
    return msgs, images


@torch.no_grad()
def hf_greedy(model_dir, data_files):
    """transformers' greedy decoding of every prompt with its images (the chat template on),
    the vision special tokens suppressed: a rollout server never samples them."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = load_image_processor(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    reward = load_reward_fn(REWARD)
    c = model.config
    vision_ids = [
        c.vision_start_token_id,
        c.vision_end_token_id,
        c.image_token_id,
        c.video_token_id,
    ]
    out = []
    for f in data_files:
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            msgs, images = _images_of(rec, f.parent)
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            s = encode_sample(text, images, tok, proc)
            gen = model.generate(
                input_ids=s.input_ids[None],
                attention_mask=torch.ones_like(s.input_ids)[None],
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
                mm_token_type_ids=s.mm_token_type_ids[None],
                max_new_tokens=MAX_NEW,
                do_sample=False,
                suppress_tokens=vision_ids,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            new = gen[0, len(s.input_ids) :].tolist()
            finish = "stop" if new and new[-1] == tok.eos_token_id else "length"
            completion = tok.decode(new, skip_special_tokens=True)
            out.append(
                {
                    "output_ids": new,
                    "completion": completion,
                    "finish": finish,
                    "reward": reward(text, completion, rec["answer"], finish_reason=finish),
                    "grid": s.image_grid_thw.tolist(),
                }
            )
    return out


def _args(model, data, out, *extra):
    return [
        "--model",
        str(model),
        "--data",
        *map(str, data),
        "--temperature",
        "0",
        "--n-samples",
        "2",
        "--max-new-tokens",
        str(MAX_NEW),
        "--reward-fn",
        REWARD,
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_greedy_eval_with_images_equals_transformers_generate(assets, tmp_path):
    model, test, extra = assets
    res = eval_main(_args(model, [test, extra], tmp_path / "r.json"))
    want = hf_greedy(model, [test, extra])
    recs = res["records"]
    assert len(recs) == len(want) == 7
    assert len({json.dumps(w["grid"]) for w in want}) >= 2  # images of several grids
    # the four count prompts have the same text: the images change the output
    assert len({tuple(w["output_ids"]) for w in want[:4]}) >= 2
    for rec, w in zip(recs, want):
        assert rec["output_ids"] == [w["output_ids"]] * 2
        assert rec["completions"] == [w["completion"]] * 2
        assert rec["finish_reasons"] == [w["finish"]] * 2
        assert rec["rewards"] == [pytest.approx(w["reward"])] * 2
    assert set(res["summary"]["per_source"]) == {"test", "extra"}
    assert res["settings"]["on_bad_image"] == "error"


def test_eval_of_a_vl_checkpoint_equals_its_hf_model(assets, tmp_path):
    """--checkpoint with one of our vision-language checkpoints: converted back to HF (with its
    image processor) first; the evaluation equals the HF model's."""
    from areal_mega.checkpoint.vl_convert import convert_vl_hf_to_mcore

    model, test, extra = assets
    ckpt = tmp_path / "mcore"
    convert_vl_hf_to_mcore(model, ckpt, dtype="fp32", make_vocab_size_divisible_by=1)
    hf = eval_main(_args(model, [test], tmp_path / "hf.json"))
    args = _args(model, [test], tmp_path / "ck.json")
    args[:2] = ["--checkpoint", str(ckpt)]
    ours = eval_main(args)
    assert [r["output_ids"] for r in ours["records"]] == [r["output_ids"] for r in hf["records"]]
    assert ours["summary"] == hf["summary"]


def test_bad_image_in_eval_data_is_named_or_skipped(assets, tmp_path, capsys):
    model, test, extra = assets
    bad = extra.parent / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "<image>x", "images": ["extra0.png"], "answer": "1"})
        + "\n"
        + json.dumps({"prompt": "<image>y", "images": ["nowhere.png"], "answer": "1"})
        + "\n"
    )
    with pytest.raises(SystemExit) as e:
        eval_cli(_args(model, [bad], tmp_path / "r.json"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "nowhere.png" in err and "not found" in err
    res = eval_main(_args(model, [bad], tmp_path / "r.json", "--on-bad-image", "skip"))
    assert [r["prompt"] for r in res["records"]] == ["<|vision_start|><|image_pad|><|vision_end|>x"]

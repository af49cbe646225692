"""Qwen2.5-VL built by the engine from Megatron-Bridge's provider (areal_mega/models/vlm): the
tiny model with its image processor, the packed forward with images = transformers' (one rank
and TP2), MegatronEngine's logprobs and a train step, the checkpoint through our conversion
tools bit for bit, the vision freeze switch, and the config keys refused.

The model checks run once in a subprocess (tests/helpers/vlm_worker.py: megatron's process
state stays out of the test process); the tiny model is written once per module."""

import json
import subprocess
import sys

import numpy as np
import pytest

from areal_mega.models.tiny import make_tiny_model
from tests.helpers.conversions import ROOT

TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("vlm") / "hf", arch="qwen2_5_vl", charset="digits"
    )


@pytest.fixture(scope="module")
def worker_out(tmp_path_factory):
    return tmp_path_factory.mktemp("vlm_out") / "res.json"


@pytest.fixture(scope="module")
def worker(hf_dir, mcore_dir, worker_out):
    out = worker_out
    p = subprocess.run(
        [sys.executable, "-m", "tests.helpers.vlm_worker", str(hf_dir), str(mcore_dir), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def test_tiny_model_has_an_image_processor_and_a_chat_template_with_the_placeholder(hf_dir):
    from transformers import AutoTokenizer

    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
    from areal_mega.models.vlm.tiny import VISION_TOKENS

    tok = AutoTokenizer.from_pretrained(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS] == [
        cfg["vision_start_token_id"],
        cfg["vision_end_token_id"],
        cfg["image_token_id"],
        cfg["video_token_id"],
    ]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "1+2="}]}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|vision_start|><|image_pad|><|vision_end|>1+2="
    proc = load_image_processor(hf_dir)
    rng = np.random.default_rng(0)
    counts = []
    for h, w in [(28, 28), (56, 28), (56, 56)]:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        s = encode_sample(text, [img], tok, proc)
        n = int(s.mm_token_type_ids.sum())
        assert int((s.input_ids == cfg["image_token_id"]).sum()) == n
        assert s.image_grid_thw.tolist() == [[1, h // 14, w // 14]]
        assert s.pixel_values.shape[0] == 4 * n  # 2x2 patches merged into each token
        counts.append(n)
    assert counts == [1, 2, 4]
    with pytest.raises(ValueError, match="1 <\\|image_pad\\|> placeholders for 2 images"):
        encode_sample(text, [img, img], tok, proc)


def test_packed_forward_with_images_equals_transformers(worker):
    assert worker["image_tokens"] == [2, 5, 0, 4]
    assert worker["mrope_section"] == [2, 3, 3]
    assert max(worker["hf_logits"]) < TOL, worker["hf_logits"]
    assert max(worker["hf_logprobs"]) < TOL, worker["hf_logprobs"]
    # the multimodal positions matter: text positions for the image tokens are far off
    assert min(worker["text_positions_diff"]) > 100 * TOL, worker["text_positions_diff"]


def test_checkpoint_tensors_in_and_out_bit_exact(worker):
    assert worker["roundtrip_same_names"] is True
    assert worker["roundtrip_max_diff"] == 0.0


def test_freeze_vision_freezes_the_tower_only(worker):
    frozen = worker["frozen"]
    assert frozen and all(n.startswith(("visual.patch_embed.", "visual.blocks.")) for n in frozen)
    assert any(n.startswith("visual.patch_embed.") for n in frozen)
    assert worker["trainable_vision"] and all(
        n.startswith("visual.merger.") for n in worker["trainable_vision"]
    )
    assert worker["trainable_without_grad"] == []


def test_engine_logprobs_and_a_train_step_with_the_vision_tower_frozen(worker):
    """MegatronEngine on the converted checkpoint: forward_logprobs of the packed micro-batch
    with its images = transformers'; an actor with model.freeze_vision takes an SFT step that
    moves the language model and the projector, not the tower."""
    assert max(worker["engine_logprobs"]) < TOL, worker["engine_logprobs"]
    assert worker["engine_trailing_padding"] < TOL and worker["engine_padding_logprobs"] == 0
    assert np.isfinite(worker["train_loss"]) and worker["train_loss"] > 0
    assert worker["train_moved"] == [
        "language_model.decoder",
        "language_model.embedding",
        "visual.merger",
    ]
    assert worker["train_frozen_moved"] == []


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.update(use_sliding_window=True), "use_sliding_window"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
        (
            lambda t: t["rope_parameters"].update(rope_type="linear", factor=2.0),
            "rope_type='linear'",
        ),
        (lambda t: t["rope_parameters"].update(mrope_section=[2, 2, 2]), "mrope_section"),
    ],
)
def test_unsupported_config_keys_are_refused(hf_dir, change, match):
    from areal_mega.models.vlm.config import check_vl_config

    cfg = json.loads((hf_dir / "config.json").read_text())
    check_vl_config(cfg)
    change(cfg["text_config"])
    with pytest.raises(ValueError, match=match):
        check_vl_config(cfg)


def _tool(*args):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm_mcore") / "mcore"
    p = _tool("tools/convert_hf_to_mcore.py", "--hf-dir", str(hf_dir), "--out", str(out))
    assert p.returncode == 0, p.stderr[-4000:]
    return out


def test_conversion_round_trip_with_our_tools_is_bit_exact(hf_dir, mcore_dir, tmp_path):
    """tools/convert_hf_to_mcore.py then tools/convert_mcore_to_hf.py: every tensor bit for
    bit, the image processor and chat template kept; a multi-rank layout is refused."""
    from safetensors.torch import load_file

    from areal_mega.checkpoint.safetensors_io import SafetensorsDir

    back = tmp_path / "back"
    p = _tool("tools/convert_mcore_to_hf.py", "--mcore-dir", str(mcore_dir), "--out", str(back))
    assert p.returncode == 0, p.stderr[-4000:]
    src = load_file(hf_dir / "model.safetensors")
    out = SafetensorsDir(back)
    assert sorted(out.keys()) == sorted(src)
    for k, t in src.items():
        got = out.get(k)
        assert got.dtype == t.dtype and got.shape == t.shape and got.equal(t), k
    for fn in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (back / fn).read_text() == (hf_dir / fn).read_text(), fn
    p = _tool(
        "tools/convert_hf_to_mcore.py",
        "--hf-dir",
        str(hf_dir),
        "--out",
        str(tmp_path / "tp2"),
        "--tp",
        "2",
    )
    assert p.returncode == 2 and "single-rank layout only" in p.stderr, p.stderr[-2000:]


def test_tensor_parallel_packed_forward_equals_transformers(hf_dir, mcore_dir, tmp_path):
    """TP2: the converted checkpoint resharded into the engine's model on two ranks; the
    gathered logits and the packed logprobs over the vocabulary shards = transformers'."""
    from areal_mega.common.net import free_port
    from tests.helpers.multirank import run_ranks
    from tests.helpers.workers import worker_cmd

    port = free_port()
    args = (hf_dir, mcore_dir)
    ranks = run_ranks(
        [worker_cmd("vlm_tp_worker", *args, r, 2, port, tmp_path) for r in range(2)],
        timeout=400,
    )
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + out[-6000:]
    for r in range(2):
        res = json.loads((tmp_path / f"tp2.{r}.json").read_text())
        assert res["tp_local_vocab"] == 64  # the padded vocabulary (128) split in two
        assert max(res["hf_logits"]) < TOL, res
        assert max(res["hf_logprobs"]) < TOL, res


@pytest.mark.parametrize("layout", ["dp2", "tp2", "tp2sp", "pp2"])
def test_two_rank_layouts_equal_the_single_rank(
    layout, worker, worker_out, hf_dir, mcore_dir, tmp_path
):
    """DP2 (a micro-batch per rank), TP2 (the vision tower replicated, its gradients averaged
    over TP as the engine finalises them), TP2 with sequence parallelism and PP2 (the tower on
    the first stage, the multimodal positions computed on both) against the single rank on the
    same two micro-batches: logprobs, loss, vision-tower gradients, the language model's
    gradient norm."""
    from areal_mega.common.net import free_port
    from tests.helpers.multirank import run_ranks
    from tests.helpers.workers import worker_cmd

    port = free_port()
    ref = f"{worker_out}.layout_ref.pt"
    args = (layout, hf_dir, mcore_dir, ref)
    ranks = run_ranks(
        [worker_cmd("vlm_layout_worker", *args, r, 2, port, tmp_path) for r in range(2)],
        timeout=400,
    )
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + out[-6000:]
    for r in range(2):
        res = json.loads((tmp_path / f"{layout}.{r}.json").read_text())
        assert res["vision_grad_scale"] > 1e-3, res  # the tower's gradients are not zero
        assert res["logprobs"] < TOL and res["loss"] < 1e-6, res
        assert res["lm_grad_norm"] < 1e-6, res
        # the vision tower: on every rank, except on the second pipeline stage
        assert res["has_vision"] == (layout != "pp2" or r == 0), res
        assert not res["has_vision"] or res["vision_grads"] < 1e-6, res


def test_untied_output_layer_round_trips_bit_exact(tmp_path):
    """A config with tie_word_embeddings=False: lm_head.weight goes to the output layer (the
    table's vocab row) and back bit for bit."""
    from safetensors.torch import load_file

    from areal_mega.checkpoint.safetensors_io import SafetensorsDir

    hf = make_tiny_model(
        tmp_path / "hf", arch="qwen2_5_vl", charset="digits", tie_word_embeddings=False
    )
    src = load_file(hf / "model.safetensors")
    assert "lm_head.weight" in src
    p = _tool("tools/convert_hf_to_mcore.py", "--hf-dir", str(hf), "--out", str(tmp_path / "m"))
    assert p.returncode == 0, p.stderr[-4000:]
    back = tmp_path / "back"
    p = _tool(
        "tools/convert_mcore_to_hf.py", "--mcore-dir", str(tmp_path / "m"), "--out", str(back)
    )
    assert p.returncode == 0, p.stderr[-4000:]
    out = SafetensorsDir(back)
    assert sorted(out.keys()) == sorted(src)
    assert all(out.get(k).equal(t) for k, t in src.items())

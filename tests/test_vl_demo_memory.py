"""The memory estimate of a vision-language model (areal_mega/launch/memory.py): the vision
tower and projector counted exactly (the tiny Qwen2.5-VL's and Qwen3-VL's checkpoints, the
published 8.29B of Qwen2.5-VL-7B and 8.77B of Qwen3-VL-8B), whole on each trainer GPU, the
frozen tower without gradients, optimizer state or kept activations, the image patches of a
micro-batch in the activations; another vision-language family refused by name; the demo and
7B recipes' dry runs."""

import json

import pytest
from safetensors import safe_open

from areal_mega.config import ModelHParams, load_config
from areal_mega.launch import local
from areal_mega.launch.memory import (
    KNOWN_MODELS,
    count_params,
    estimate_memory,
    hparams_from_hf_config,
    known_model_key,
    vision_param_counts,
)
from areal_mega.models.tiny import make_tiny_model
from areal_mega.parallel.allocation import ParallelDims
from tests.helpers.workers import ROOT

VL = ModelHParams(
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    vocab_size=100,
    tie_word_embeddings=True,
    qkv_bias=True,
    vision_depth=2,
    vision_hidden_size=32,
    vision_intermediate_size=64,
    vision_patch_dim=1176,
    vision_merge_size=2,
)


def test_tiny_checkpoint_counted_exactly_tower_and_projector_apart(tmp_path):
    d = make_tiny_model(tmp_path / "m", arch="qwen2_5_vl", charset="ascii", hidden_size=64)
    hp = hparams_from_hf_config(d / "config.json")
    assert (hp.vision_depth, hp.vision_patch_dim, hp.vision_merge_size) == (2, 1176, 2)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_tensor(k).numel() for k in f.keys()}
    c = count_params(hp)
    assert c.total == sum(sizes.values())
    assert c.vision_merger == sum(n for k, n in sizes.items() if k.startswith("visual.merger."))
    assert c.vision_tower == sum(
        n for k, n in sizes.items() if k.startswith(("visual.patch_embed.", "visual.blocks."))
    )


def test_tiny_qwen3_vl_checkpoint_counted_exactly_tower_and_mergers_apart(tmp_path):
    """Qwen3-VL's tower (patch embedding with a bias, learnt position grid, LayerNorm blocks
    with a GELU MLP) and its mergers (the projector and one deepstack merger per deepstack
    block, which model.freeze_vision keeps training) equal the checkpoint's tensors."""
    d = make_tiny_model(tmp_path / "m", arch="qwen3_vl", charset="ascii", hidden_size=64)
    hp = hparams_from_hf_config(d / "config.json")
    assert (hp.vision_family, hp.vision_patch_dim, hp.vision_position_embeddings) == (
        "qwen3_vl",
        3 * 2 * 16 * 16,
        16,
    )
    assert (hp.vision_deepstack_layers, hp.qk_norm, hp.qkv_bias) == (1, True, False)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_tensor(k).numel() for k in f.keys()}
    c = count_params(hp)
    assert c.total == sum(sizes.values())
    assert c.vision_merger == sum(
        n
        for k, n in sizes.items()
        if k.startswith(("model.visual.merger.", "model.visual.deepstack_merger_list."))
    )
    assert c.vision_tower == sum(
        n
        for k, n in sizes.items()
        if k.startswith(
            ("model.visual.patch_embed.", "model.visual.pos_embed.", "model.visual.blocks.")
        )
    )


def test_qwen3_vl_8b_published_size_and_name():
    c = count_params(KNOWN_MODELS["qwen3-vl-8b"])
    assert c.total == pytest.approx(8.77e9, rel=0.002)
    assert known_model_key("Qwen/Qwen3-VL-8B-Instruct") == "qwen3-vl-8b"


def test_qwen25_vl_7b_published_size_and_name():
    c = count_params(KNOWN_MODELS["qwen2.5-vl-7b"])
    assert c.total == pytest.approx(8.29e9, rel=0.005)
    assert c.vision == pytest.approx(0.676e9, rel=0.01)
    assert known_model_key("Qwen/Qwen2.5-VL-7B-Instruct") == "qwen2.5-vl-7b"
    assert known_model_key("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"


def test_vision_tower_whole_on_each_gpu_and_frozen_without_state():
    tower, merger = vision_param_counts(VL)
    text = ModelHParams(**{**VL.__dict__, "vision_depth": 0})
    dims = ParallelDims(dp=2, tp=2)
    kw = dict(tokens_per_mb=1000, overhead_bytes=0, image_tokens_per_mb=100)
    plain = estimate_memory(text, dims, **kw)
    trained = estimate_memory(VL, dims, **kw)
    frozen = estimate_memory(VL, dims, freeze_vision=True, **kw)
    # whole (not divided by TP) on every GPU
    assert trained.params_per_gpu == plain.params_per_gpu + tower + merger
    assert trained.weights - plain.weights == 2 * (tower + merger)
    assert trained.grads - plain.grads == 4 * (tower + merger)
    assert frozen.grads - plain.grads == 4 * merger
    assert trained.optimizer - plain.optimizer == 12 * (tower + merger) / 2
    assert frozen.optimizer - plain.optimizer == 12 * merger / 2
    # 100 image tokens = 400 patches; per block 2 B x (4*32 + 4*32 + 4*64) per patch; the
    # projector keeps its input (2*32*4 + 64 per image token)
    block = 400 * 2 * (4 * 32 + 4 * 32 + 4 * 64)
    merger_act = 100 * 2 * (2 * 32 * 4 + 64)
    assert trained.activations - plain.activations == 2 * block + merger_act + block
    assert frozen.activations - plain.activations == merger_act + block
    # the default bound: every token of the micro-batch an image token
    bound = estimate_memory(VL, dims, tokens_per_mb=1000, overhead_bytes=0, freeze_vision=True)
    assert bound.activations > frozen.activations
    assert any("upper bound" in n for n in bound.notes)


def test_other_vision_language_configs_are_refused_by_name(tmp_path):
    d = make_tiny_model(tmp_path / "m", arch="qwen2_5_vl", charset="ascii")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "glm4v"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="glm4v.*vision tower.*model_hparams"):
        hparams_from_hf_config(d / "config.json")
    with pytest.raises(Exception, match="vision_hidden_size"):
        count_params(ModelHParams(**{**VL.__dict__, "vision_hidden_size": 0}))


@pytest.mark.parametrize("name", ["tiny-vl-cpu", "qwen2.5-vl-7b-geo"])
def test_recipe_dry_run_counts_the_vision_tower(name):
    cfg = load_config(ROOT / "recipes" / f"{name}.yaml")
    out = local.describe(cfg)
    assert "vision tower:" in out and "DOES NOT FIT" not in out
    if name == "qwen2.5-vl-7b-geo":
        assert cfg.model.freeze_vision and "(frozen)" in out
        assert "total 67.03 GiB per GPU of 80 GiB" in out  # the recipe's arithmetic

"""Qwen3-VL (qwen3_vl) built by the engine from Megatron-Bridge's provider and model classes on
megatron-core's local layers (areal_mega/models/vlm/qwen3_vl.py): the tiny model with its image
processor, the packed forward with images = transformers' (deepstack features and interleaved
multimodal RoPE biting), the checkpoint through our conversion bit for bit, MegatronEngine's
logprobs and a train step with the tower frozen, DP2 / TP2 / TP2+SP / PP2 against one rank, the
config keys refused; Qwen3-VL-MoE refused naming why; the upstream facts the build works around
(TransformerEngine-only provide(), the mergers' activation), checked in the installed bridge so
this file fails once upstream changes them.

The model checks run once in a subprocess (tests/helpers/qwen3_vl_worker.py)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_mega.models.bridge_provider import NOT_BUILT, VL_NOT_BUILT
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.conversions import ROOT

TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen3_vl") / "hf", arch="qwen3_vl", charset="digits"
    )


def _tool(*args):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_vl_mcore") / "mcore"
    p = _tool("tools/convert_hf_to_mcore.py", "--hf-dir", str(hf_dir), "--out", str(out))
    assert p.returncode == 0, p.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def worker_out(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_vl_out") / "res.json"


@pytest.fixture(scope="module")
def worker(hf_dir, mcore_dir, worker_out):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.helpers.qwen3_vl_worker",
            str(hf_dir),
            str(mcore_dir),
            str(worker_out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(worker_out.read_text())


def test_tiny_model_config_tokens_and_image_processor(hf_dir):
    """Qwen3-VL's config with the features that bite (deepstack from the first block, a 4x4
    position grid interpolated per image, QK norms) and transformers' PIL processor with
    16-pixel patches: one to four merged patches per 32..64-pixel image."""
    from transformers import AutoTokenizer

    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
    from areal_mega.models.vlm.tiny import VISION_TOKENS

    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl"
    assert cfg["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert cfg["vision_config"]["deepstack_visual_indexes"] == [0]
    assert cfg["vision_config"]["patch_size"] == 16
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS] == [
        cfg["vision_start_token_id"],
        cfg["vision_end_token_id"],
        cfg["image_token_id"],
        cfg["video_token_id"],
    ]
    proc = load_image_processor(hf_dir)
    assert (proc.patch_size, proc.merge_size) == (16, 2)
    rng = np.random.default_rng(0)
    text = "<|vision_start|><|image_pad|><|vision_end|>1+2="
    counts = []
    for h, w in [(32, 32), (64, 32), (64, 64)]:
        s = encode_sample(text, [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)], tok, proc)
        assert s.image_grid_thw.tolist() == [[1, h // 16, w // 16]]
        counts.append(int(s.mm_token_type_ids.sum()))
    assert counts == [1, 2, 4]


def test_packed_forward_with_images_equals_transformers(worker):
    """One packed THD micro-batch of four samples (two images, one, none, one) = transformers'
    logits and logprobs on each sample alone; the bridge's own model class; the multimodal
    positions and the deepstack features bite."""
    assert worker["model_class"] == "Qwen3VLModel"
    assert worker["image_tokens"] == [2, 5, 0, 4]
    assert worker["mrope_section"] == [2, 3, 3]
    assert max(worker["hf_logits"]) < TOL, worker["hf_logits"]
    assert max(worker["hf_logprobs"]) < TOL, worker["hf_logprobs"]
    assert min(worker["text_positions_diff"]) > 100 * TOL, worker["text_positions_diff"]
    assert worker["no_deepstack_diff"] > 100 * TOL, worker["no_deepstack_diff"]


def test_patch_mergers_take_transformers_exact_gelu(worker):
    """The bridge's patch mergers take the blocks' tanh-approximated GELU, transformers' the
    exact one (nn.GELU()): ours set the exact one (qwen3_vl.merger_modules). Fails once the
    bridge's mergers have it themselves (then drop the correction)."""
    assert worker["bridge_merger_activation_is_exact_gelu"] is False
    assert worker["exact_gelu_diff"] > TOL, worker["exact_gelu_diff"]
    assert worker["restored_diff"] < TOL, worker["restored_diff"]


def test_checkpoint_tensors_in_and_out_bit_exact(worker):
    assert worker["roundtrip_same_names"] is True
    assert worker["roundtrip_max_diff"] == 0.0


def test_freeze_vision_freezes_the_tower_not_its_mergers(worker):
    from tests.helpers.qwen3_vl_worker import FROZEN_TOWER

    frozen = worker["frozen"]
    assert frozen and all(n.startswith(FROZEN_TOWER) for n in frozen)
    assert "vision_model.pos_embed.weight" in frozen
    mergers = ("vision_model.merger.", "vision_model.decoder.deepstack_merger_list.")
    trainable = worker["trainable_vision"]
    assert all(n.startswith(mergers) for n in trainable)
    assert all(any(n.startswith(m) for n in trainable) for m in mergers)
    assert worker["trainable_without_grad"] == []


def test_engine_logprobs_and_a_train_step_with_the_vision_tower_frozen(worker):
    assert max(worker["engine_logprobs"]) < TOL, worker["engine_logprobs"]
    assert worker["engine_trailing_padding"] < TOL and worker["engine_padding_logprobs"] == 0
    assert np.isfinite(worker["train_loss"]) and worker["train_loss"] > 0
    assert worker["train_moved"] == [
        "language_model.decoder",
        "language_model.embedding",
        "vision_model.decoder",  # the deepstack mergers
        "vision_model.merger",
    ]
    assert worker["train_frozen_moved"] == []


def test_conversion_round_trip_with_our_tools_is_bit_exact(hf_dir, mcore_dir, tmp_path):
    from safetensors.torch import load_file

    from areal_mega.checkpoint.safetensors_io import SafetensorsDir

    back = tmp_path / "back"
    p = _tool("tools/convert_mcore_to_hf.py", "--mcore-dir", str(mcore_dir), "--out", str(back))
    assert p.returncode == 0, p.stderr[-4000:]
    src = load_file(hf_dir / "model.safetensors")
    assert any(k.startswith("model.visual.deepstack_merger_list.") for k in src)
    out = SafetensorsDir(back)
    assert sorted(out.keys()) == sorted(src)
    for k, t in src.items():
        got = out.get(k)
        assert got.dtype == t.dtype and got.shape == t.shape and got.equal(t), k
    for fn in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (back / fn).read_text() == (hf_dir / fn).read_text(), fn


@pytest.mark.parametrize("layout", ["dp2", "tp2", "tp2sp", "pp2"])
def test_two_rank_layouts_equal_the_single_rank(
    layout, worker, worker_out, hf_dir, mcore_dir, tmp_path
):
    """DP2, TP2 (the tower of megatron layers tensor-parallel too: its gradients gathered),
    TP2 with sequence parallelism (the deepstack features split with the sequence) and PP2
    (tower and deepstack on the first stage) against the single rank on the same two
    micro-batches (tests/helpers/vlm_layout_worker.py)."""
    from areal_mega.common.net import free_port
    from tests.helpers.multirank import run_ranks
    from tests.helpers.workers import worker_cmd

    port = free_port()
    args = (layout, hf_dir, mcore_dir, f"{worker_out}.layout_ref.pt")
    ranks = run_ranks(
        [worker_cmd("vlm_layout_worker", *args, r, 2, port, tmp_path) for r in range(2)],
        timeout=400,
    )
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + out[-6000:]
    for r in range(2):
        res = json.loads((tmp_path / f"{layout}.{r}.json").read_text())
        assert res["vision_grad_scale"] > 1e-3, res
        assert res["logprobs"] < TOL and res["loss"] < 1e-6, res
        assert res["lm_grad_norm"] < 1e-6, res
        assert res["has_vision"] == (layout != "pp2" or r == 0), res
        assert not res["has_vision"] or res["vision_grads"] < 1e-6, res


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c: c["text_config"].update(attention_bias=True), "attention_bias"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "text_config.hidden_act"),
        (lambda c: c["vision_config"].update(hidden_act="gelu"), "vision_config.hidden_act"),
        (
            lambda c: c["text_config"]["rope_parameters"].update(rope_type="linear", factor=2.0),
            "rope_type='linear'",
        ),
        (
            lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]),
            "mrope_section",
        ),
        (
            lambda c: c["vision_config"].update(num_position_embeddings=12),
            "num_position_embeddings=12",
        ),
    ],
)
def test_unsupported_config_keys_are_refused(hf_dir, change, match):
    from areal_mega.models.vlm.config import check_vl_config

    cfg = json.loads((hf_dir / "config.json").read_text())
    check_vl_config(cfg)
    change(cfg)
    with pytest.raises(ValueError, match=match):
        check_vl_config(cfg)


def test_qwen3_vl_moe_is_refused_naming_why(tmp_path):
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError, read_arch
    from areal_mega.inference import model_support as ms
    from areal_mega.models.builder import parse_hf_config
    from areal_mega.models.vlm.config import is_vl_config

    hf = {"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"]}
    assert VL_NOT_BUILT == ("qwen3_vl_moe",) and not is_vl_config(hf)
    with pytest.raises(ValueError, match="grouped-GEMM expert spec"):
        parse_hf_config(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match="experts packed in one tensor"):
        read_arch(tmp_path)
    archs = ms.vl_not_built_architectures()
    assert archs == {"Qwen3VLMoeForConditionalGeneration": NOT_BUILT["qwen3_vl_moe"]}
    (row,) = ms.support_rows(
        ["Qwen3VLMoeForConditionalGeneration"],
        engine={},
        causal_lm={},
        kv_paths={},
        vl_not_built=archs,
    )
    assert row["status"] == ms.STATUS["no"] and row["status_note"] == NOT_BUILT["qwen3_vl_moe"]
    assert "Qwen3VLForConditionalGeneration" in ms.vl_rl_architectures()
    doc = (Path(ROOT) / "docs" / "model_families.md").read_text()
    assert NOT_BUILT["qwen3_vl_moe"] in doc


def _bridge_source(module: str) -> str:
    """A Megatron-Bridge module's source, read from disk without importing the bridge (its
    import needs our TransformerEngine placeholder and takes ~20 s)."""
    import importlib.util

    (root,) = importlib.util.find_spec("megatron").submodule_search_locations[:1]
    path = Path(root).joinpath(*module.split(".")[1:]).with_suffix(".py")
    assert path.is_file(), path
    return path.read_text()


def _function_source(text: str, header: str) -> str:
    """The function of ``text`` that starts at ``header``, up to the next definition at the
    same or a lower indentation."""
    start = text.index(header)
    indent = len(text[:start].rsplit("\n", 1)[-1])
    lines = text[start:].split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        stripped = line.lstrip()
        if (
            stripped
            and len(line) - len(stripped) <= indent
            and stripped.startswith(("def ", "class ", "@"))
        ):
            break
        body.append(line)
    return "\n".join(body)


def test_upstream_still_builds_qwen3_vl_from_transformer_engine_layers_only():
    """What areal_mega/models/vlm/qwen3_vl.py stands in for, in the installed bridge: the
    provider's provide() passes TE's GPT layer spec to the model (no provide_language_model
    hook), the model's constructor builds the vision tower from TE's ViT spec and TE patch
    mergers, the rotary embeddings allocate on the CUDA device (compat's bridge patches), the
    mergers take the blocks' activation, the deepstack features are sliced per
    sequence-parallel rank without summing their gradient."""
    provider = _bridge_source("megatron.bridge.models.qwen_vl.qwen3_vl_provider")
    for cls in ("class Qwen3VLModelProvider", "class Qwen3VLMoEModelProvider"):
        provide = _function_source(provider[provider.index(cls) :], "def provide(")
        assert "get_gpt_layer_with_transformer_engine_spec(" in provide, cls
        assert "provide_language_model" not in provide, cls
    model = _bridge_source("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model")
    init = _function_source(model[model.index("class Qwen3VLModel(") :], "def __init__(")
    assert "get_vit_layer_with_transformer_engine_spec()" in init
    for te in ("patch_norm=TENorm", "TEColumnParallelLinear", "TERowParallelLinear"):
        assert te in init, te
    assert "if self.pre_process and self.add_encoder:" in init
    utils = _bridge_source("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils")
    assert "self.activation_func = self.config.activation_func" in utils
    # the deepstack features sliced per sequence-parallel rank with no gradient reduction
    # (our forward hook sums it: qwen3_vl._deepstack_grads_summed_over_tp)
    split = _function_source(utils, "def split_deepstack_embs(")
    assert "deepstack_visual_embed[tp_slice]" in split
    assert not any(c in split for c in ("all_reduce", "_region", "autograd"))
    from areal_mega.compat.megatron_cpu import bridge_patches

    names = {p.module for p in bridge_patches("megatron.bridge.models.qwen_vl.modelling_qwen3_vl")}
    assert len(names) == 2
    for module in names:
        assert "device=torch.cuda.current_device()" in _bridge_source(module), module


def test_vl_table_vision_rows():
    """A tower of megatron layers: its rows become patterns (TE's fused norm names made the
    local norms'); other kinds refused; without a vision prefix such rows are refused."""
    from areal_mega.checkpoint.bridge_tables import UnsupportedMappingError, vl_table_from_rows
    from areal_mega.checkpoint.vl_mapping import hf_sources, vl_table

    rows = [
        {
            "megatron": "vision_model.decoder.layers.*.self_attention.linear_qkv.layer_norm_weight",
            "hf": ["model.visual.blocks.*.norm1.weight"],
            "kind": "copy",
        },
        {
            "megatron": "vision_model.decoder.layers.*.self_attention.linear_qkv.weight",
            "hf": ["model.visual.blocks.*.attn.qkv.weight"],
            "kind": "qkv_concat",
        },
        {
            "megatron": "vision_model.merger.patch_norm.**",
            "hf": ["model.visual.merger.norm.**"],
            "kind": "copy",
        },
    ]
    table = vl_table_from_rows(rows, "vision_model.")
    assert table["vision"][0]["mcore"] == "vision_model.decoder.layers.*.input_layernorm.weight"
    with pytest.raises(UnsupportedMappingError, match="neither the language model"):
        vl_table_from_rows(rows)
    with pytest.raises(UnsupportedMappingError, match="a vision row of kind 'glu'"):
        vl_table_from_rows([dict(rows[0], kind="glu")], "vision_model.")
    stored = vl_table("qwen3_vl")
    assert hf_sources(stored, "vision_model.decoder.layers.12.self_attention.linear_qkv.bias") == (
        ["model.visual.blocks.12.attn.qkv.bias"],
        "qkv_concat",
    )
    assert hf_sources(stored, "vision_model.merger.patch_norm.weight") == (
        ["model.visual.merger.norm.weight"],
        "copy",
    )
    assert hf_sources(stored, "language_model.decoder.layers.3.self_attention.q_layernorm.weight")[
        0
    ] == ["model.language_model.layers.3.self_attn.q_norm.weight"]


def test_untied_output_layer_round_trips_bit_exact(tmp_path):
    """tie_word_embeddings=False (the larger released models): lm_head.weight goes to the
    output layer and back bit for bit."""
    from safetensors.torch import load_file

    from areal_mega.checkpoint.safetensors_io import SafetensorsDir

    hf = make_tiny_model(
        tmp_path / "hf", arch="qwen3_vl", charset="digits", tie_word_embeddings=False
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

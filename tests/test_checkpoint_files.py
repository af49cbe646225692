"""Checkpoint files: completeness checks name the broken file, `latest` / `find_latest` never
pick a half-written checkpoint, pruning keeps the newest, and the HF<->megatron mapping's
layout transforms (pure functions) are exact inverses with megatron's QKV grouping."""

import shutil

import pytest
import torch

from areal_mega.checkpoint import hf_mapping as hm
from areal_mega.checkpoint.convert import convert_mcore_to_hf
from areal_mega.checkpoint.dist_ckpt import (
    CheckpointError,
    find_latest,
    prune_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
)
from tests.helpers.conversions import run_jobs, session_dir


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    work = run_jobs(session_dir(tmp_path_factory))
    return work / "qwen2_untied_bias" / "mcore" / "iter_0000000"


def _copy(ckpt, tmp_path, name="iter_0000000"):
    dst = tmp_path / "root" / name
    shutil.copytree(ckpt, dst)
    return dst


def test_verify_ok_and_resolve_root(ckpt, tmp_path):
    meta = verify_checkpoint(ckpt)
    assert meta["complete"] and meta["iteration"] == 0
    assert resolve_checkpoint(ckpt.parent) == ckpt


def test_truncated_and_missing_shards_are_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    shard = sorted(d.glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="truncated checkpoint shard") as e:
        verify_checkpoint(d)
    assert str(shard) in str(e.value)
    with pytest.raises(CheckpointError, match="truncated"):
        convert_mcore_to_hf(d, tmp_path / "hf", progress=False)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing checkpoint shard") as e:
        verify_checkpoint(d)
    assert str(shard) in str(e.value)


def test_incomplete_checkpoint_is_refused(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    (d / "areal_meta.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        verify_checkpoint(d)
    with pytest.raises(CheckpointError, match="no complete checkpoint found"):
        resolve_checkpoint(d.parent)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")


def test_latest_never_points_at_half_written(ckpt, tmp_path):
    good = _copy(ckpt, tmp_path, "iter_0000003")
    root = good.parent
    shutil.copytree(ckpt, root / "iter_0000007.tmp")  # interrupted save
    half = root / "iter_0000009"
    shutil.copytree(ckpt, half)
    (half / "areal_meta.json").unlink()  # renamed but never marked
    (root / "latest").write_text("iter_0000009\n")  # stale pointer
    assert find_latest(root) == good
    assert resolve_checkpoint(root) == good
    older = _copy(ckpt, tmp_path, "iter_0000001")
    (root / "latest").write_text("iter_0000003\n")
    deleted = prune_checkpoints(root, keep_last=1)
    assert older in deleted and (root / "iter_0000007.tmp") in deleted
    assert good.exists() and not older.exists()


@pytest.mark.parametrize("heads, kv, d", [(4, 2, 16), (4, 4, 8), (8, 1, 4)])
def test_qkv_grouping_and_inverses(heads, kv, d):
    h = 32
    q = torch.randn(heads * d, h)
    k = torch.randn(kv * d, h)
    v = torch.randn(kv * d, h)
    fused = hm.qkv_to_mcore(q, k, v, heads, kv, d)
    r = heads // kv
    # megatron's layout: per KV group g, r query heads, then k_g, then v_g
    g0 = fused[: (r + 2) * d]
    assert torch.equal(g0[: r * d], q[: r * d]) and torch.equal(g0[r * d : (r + 1) * d], k[:d])
    assert torch.equal(g0[(r + 1) * d :], v[:d])
    assert all(torch.equal(a, b) for a, b in zip(hm.qkv_to_hf(fused, heads, kv, d), (q, k, v)))

    class A:
        num_heads, num_kv_heads, head_dim, vocab_size = heads, kv, d, 0

    segs = hm.to_hf_segments(A, "qkv", fused)
    assert all(torch.equal(torch.cat(s), t) for s, t in zip(segs, (q, k, v)))
    streamed = torch.cat(
        list(hm.to_mcore_segments(A, "qkv", ["q", "k", "v"], {"q": q, "k": k, "v": v}.get))
    )
    assert torch.equal(streamed, fused)


def test_vocab_and_glu_inverses():
    t = torch.randn(103, 8)
    p = hm.pad_vocab(t, 128)
    assert p.shape == (128, 8) and torch.equal(p[103:], torch.zeros(25, 8))
    assert torch.equal(hm.unpad_vocab(p, 103), t)
    g, u = torch.randn(6, 4), torch.randn(6, 4)
    assert all(torch.equal(a, b) for a, b in zip(hm.glu_to_hf(hm.glu_to_mcore(g, u)), (g, u)))


def test_megatron_name_parsing_local_and_te():
    assert hm.parse_mcore_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == (
        3,
        None,
        "input_layernorm.weight",
    )
    assert hm.parse_mcore_name(
        "module.module.decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    ) == (1, None, "pre_mlp_layernorm.weight")
    assert hm.parse_mcore_name(
        "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"
    ) == (0, 2, "mlp.experts.local_experts.{E}.linear_fc2.weight")
    assert hm.parse_mcore_name("decoder.layers.0.mlp.experts.linear_fc1.weight5") == (
        0,
        5,
        "mlp.experts.local_experts.{E}.linear_fc1.weight",
    )
    assert hm.parse_mcore_name("output_layer.weight") == (None, None, "output_layer.weight")
    with pytest.raises(hm.UnsupportedModelError, match="GroupedMLP"):
        hm.parse_mcore_name("decoder.layers.0.mlp.experts.weight1")


def test_config_spellings_are_both_accepted():
    base = dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        head_dim=16,
    )
    a = hm.read_arch(dict(base, num_local_experts=4, rope_parameters={"rope_theta": 5e5}))
    b = hm.read_arch(dict(base, num_experts=4, rope_theta=5e5))
    assert a == b and a.num_experts == 4 and a.rope_theta == 5e5

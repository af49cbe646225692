"""Pure parts of the engine: HF config -> TransformerConfig, vocab padding, packed helpers
(labels check, block-diagonal mask) and the zigzag CP split / merge."""

import pytest
import torch

from areal_mega.engine.packed import (
    block_causal_mask,
    micro_batch_labels,
    zigzag_index,
    zigzag_merge,
    zigzag_split,
)
from areal_mega.models.builder import padded_vocab_size, parse_hf_config
from areal_mega.scheduler.packing import pack_sequences, zigzag_cp_shard
from areal_mega.train.batches import next_token_layout

BASE = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=128,
    rope_theta=123456.0,
    rms_norm_eps=1e-5,
)


def test_parse_families():
    a = parse_hf_config(dict(BASE, model_type="llama", tie_word_embeddings=True))
    assert (a.num_kv_heads, a.head_dim, a.rope_theta, a.rms_norm_eps) == (2, 8, 123456.0, 1e-5)
    assert a.tie_word_embeddings and not a.qkv_bias and not a.qk_norm
    q2 = parse_hf_config(dict(BASE, model_type="qwen2"))
    assert q2.qkv_bias and not q2.qk_norm and not q2.tie_word_embeddings
    q3 = parse_hf_config(dict(BASE, model_type="qwen3", head_dim=32))
    assert q3.qk_norm and q3.head_dim == 32 and not q3.qkv_bias
    moe = parse_hf_config(
        dict(
            BASE,
            model_type="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        )
    )
    assert moe.is_moe and moe.moe_layer_pattern == (0, 1, 1, 1) and not moe.moe_norm_topk_prob
    with pytest.raises(ValueError, match="model_type"):
        parse_hf_config(dict(BASE, model_type="gpt2"))
    with pytest.raises(ValueError, match="rope_scaling"):
        parse_hf_config(dict(BASE, model_type="llama", rope_scaling={"rope_type": "yarn"}))


def test_transformer_config_matches_hf():
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply()
    from areal_mega.models.builder import transformer_config_from_hf

    arch = parse_hf_config(
        dict(
            BASE,
            model_type="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
        )
    )
    c = transformer_config_from_hf(arch, tp=2, pp=2)
    assert (c.num_query_groups, c.kv_channels, c.layernorm_epsilon) == (2, 8, 1e-5)
    assert c.qk_layernorm and c.normalization == "RMSNorm" and c.gated_linear_unit
    assert c.pipeline_model_parallel_size == 2 and c.moe_token_dispatcher_type == "alltoall"
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 16)
    assert c.moe_router_pre_softmax is False  # norm_topk_prob=True: renormalised top-k
    with pytest.raises(ValueError, match="num_key_value_heads"):
        transformer_config_from_hf(arch, tp=4)


def test_interleaved_pp2_splits_forward_and_backward_p2p():
    """PP2 × VPP: separate forward/backward exchanges (the peer is both prev and next);
    other layouts keep megatron's batched p2p."""
    from areal_mega.models.builder import interleaved_p2p_settings

    assert interleaved_p2p_settings(2, 2) == {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    assert interleaved_p2p_settings(2, None) == {}
    assert interleaved_p2p_settings(4, 2) == {}
    assert interleaved_p2p_settings(2, 1) == {}


def test_padded_vocab_is_tp_independent():
    assert padded_vocab_size(1000, 128, 1) == padded_vocab_size(1000, 128, 8) == 1024
    assert padded_vocab_size(151936, 128, 2) == 151936
    assert padded_vocab_size(10, 1, 4) == 12


def _mb(lens, cp=1, pad=1):
    seqs = [next_token_layout(torch.arange(100 * i, 100 * i + n)) for i, n in enumerate(lens)]
    return pack_sequences(seqs, pad_to_multiple=pad, cp_size=cp)


def test_labels_and_mask():
    mb = _mb([3, 1, 2], pad=4)  # T = 8: [0 1 2 | 100 | 200 201 | pad pad]
    labels = micro_batch_labels(mb, 8)
    assert labels.dtype == torch.long
    assert labels.tolist() == [1, 2, -1, -1, 201, -1, -1, -1]  # -1: last token, padding
    cp = _mb([3, 1], cp=2, pad=4)  # slots of 4: [0 1 2 pad | 100 pad pad pad]
    assert cp["labels"].tolist() == [1, 2, -1, -1, -1, -1, -1, -1]
    assert pack_sequences([], pad_to_multiple=4)["labels"].tolist() == [-1] * 4
    with pytest.raises(ValueError, match="no 'labels' field"):
        micro_batch_labels(pack_sequences([{"input_ids": [1, 2, 3]}]), 3)
    with pytest.raises(ValueError, match="'labels' must be integer \\[8\\]"):
        micro_batch_labels({**mb, "labels": mb["labels"][:5]}, 8)
    m = block_causal_mask(mb["segment_ids"].long())[0, 0]
    assert m.shape == (8, 8)
    assert not m[2, 0] and m[0, 2] and m[3, 2] and not m[5, 4] and m[4, 3] and not m[7, 6]
    assert (~m).any(dim=1).all()  # no fully masked row


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_zigzag_split_merge_roundtrip_and_matches_scheduler(cp):
    mb = _mb([5, 12, 1, 7], cp=cp, pad=2 * cp * 2)
    total = mb["input_ids"].shape[0]
    bounds = mb["cu_seqlens_padded"].tolist()
    shards = [zigzag_split(mb["input_ids"], bounds, cp, r) for r in range(cp)]
    assert sum(s.numel() for s in shards) == total
    assert torch.equal(zigzag_merge(shards, bounds, total), mb["input_ids"])
    for r in range(cp if cp > 1 else 0):  # the scheduler's shard requires cp > 1
        assert torch.equal(shards[r], zigzag_cp_shard(mb, r, cp)["input_ids"])
    if cp == 2:  # each slot of 8: rank 0 keeps chunks 0 and 3
        idx = zigzag_index(bounds, total, 2, 0)
        assert idx[:4].tolist() == [0, 1, 6, 7]


def test_zigzag_rejects_unpadded():
    with pytest.raises(ValueError, match="multiple of 2"):
        zigzag_index([0, 5], 5, 2, 0)


def test_parse_hf_config_reads_transformers5_moe_config(tmp_path):
    """transformers 5 writes num_local_experts / rope_parameters; hub files num_experts /
    rope_theta: the builder reads both (one normaliser, shared with the converter)."""
    from areal_mega.models.builder import load_hf_config, parse_hf_config
    from areal_mega.models.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4, rope_theta=5e5)
    hf = load_hf_config(out)
    assert "num_local_experts" in hf and "num_experts" not in hf
    arch = parse_hf_config(hf)
    assert arch.num_experts == 4 and arch.rope_theta == 5e5
    hub = {k: v for k, v in hf.items() if k not in ("num_local_experts", "rope_parameters")}
    hub.update(num_experts=4, rope_theta=5e5)
    assert parse_hf_config(hub) == arch

"""The algorithm pipeline on a batch packed by the real scheduler: adapt field names, shape
rewards, filter, compute advantages, split into micro-batches and evaluate the loss."""

import dataclasses
import math

import pytest
import torch

from areal_mega.algo import (
    compute_advantages,
    dynamic_filter,
    finalize_stats,
    make_policy_loss,
    split_micro_batches,
    with_algo_fields,
)
from areal_mega.config import AlgorithmConfig
from areal_mega.scheduler.packing import pack_sequences


def trajectories():
    # 3 prompt groups x 2 samples; prompt of 2 tokens; group "b" is uniform (both reward 1)
    spec = [
        ("a", 1.0, 3, "stop"),
        ("a", 0.0, 4, "length"),
        ("b", 1.0, 2, "stop"),
        ("b", 1.0, 3, "stop"),
        ("c", 0.0, 2, "stop"),
        ("c", 1.0, 5, "stop"),
    ]
    out = []
    for i, (g, r, n_gen, fin) in enumerate(spec):
        n = 2 + n_gen
        lp = torch.zeros(n)
        lp[2:] = -0.5 - 0.1 * torch.arange(n_gen)
        out.append(
            {
                "input_ids": torch.arange(n) + 10 * i,
                "prompt_len": 2,
                "logprobs": lp,
                "reward": r,
                "group_id": g,
                "finish_reason": fin,
                "sample_id": f"s{i}",
            }
        )
    return out


def test_scheduler_batch_through_the_pipeline():
    packed = pack_sequences(trajectories(), pad_to_multiple=8)
    batch = with_algo_fields(packed)
    assert batch["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["seq_no_eos"].tolist() == [False, True, False, False, False, False]
    assert batch["response_lens"].tolist() == [3, 4, 2, 3, 2, 5]
    assert batch["logprobs"] is packed["logprobs"]

    cfg = dataclasses.replace(
        AlgorithmConfig(),
        zero_reward_without_eos=True,
        dynamic_filter=True,
        group_std=False,
        loss_agg="seq_mean",
    )
    batch, fstats = dynamic_filter(batch, cfg.dynamic_filter)
    assert fstats["uniform_groups"] == 1 and fstats["seqs_dropped"] == 2
    assert batch["sample_ids"] == ["s0", "s1", "s4", "s5"]
    assert (
        batch["segment_ids"][: batch["cu_seqlens"][-1]].tolist()
        == [0] * 5 + [1] * 6 + [2] * 4 + [3] * 7
    )
    adv, st = compute_advantages(batch, cfg, max_response_len=8)
    batch["advantages"] = adv["advantages"]
    # group a: [1, 0] (no EOS zeroes nothing new) -> ±0.5; group c: [0, 1] -> ∓0.5
    per_seq = [float(batch["advantages"][int(batch["cu_seqlens"][b]) + 2]) for b in range(4)]
    assert per_seq == [0.5, -0.5, -0.5, 0.5]
    batch["prox_logprobs"] = batch["logprobs"].clone()

    loss_fn, den_fn = make_policy_loss(cfg)
    mbs = split_micro_batches(batch, 2)
    den = sum(den_fn(mb) for mb in mbs)
    assert den == 4
    total, sums = 0.0, {}
    for mb in mbs:
        num, stats = loss_fn(mb["prox_logprobs"].clone().requires_grad_(), None, mb)
        total += float(num.detach())
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    # on-policy: ratio 1, loss per sequence = -A, mean over sequences = 0
    assert total / den == pytest.approx(0.0, abs=1e-7)
    out = finalize_stats(sums)
    assert out["token_count"] == 3 + 4 + 2 + 5 and out["seq_count"] == 4
    assert out["ppo_kl"] == 0.0 and out["mismatch"] == 0.0 and out["clip_frac"] == 0.0
    assert math.isfinite(out["imp_weight"]) and out["imp_weight"] == 1.0

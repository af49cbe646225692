"""Reward shaping, group/batch normalisation, advantage estimators, filters (the KL
estimators are in test_algo_kl.py)."""

import dataclasses
import math

import pytest
import torch

import areal_mega.ops as ops
from areal_mega.algo import (
    compute_advantages,
    dynamic_filter,
    group_normalize,
    masked_whiten,
    outcome_token_rewards,
    overlong_penalty,
    shape_rewards,
    uniform_groups,
)
from areal_mega.config import AlgorithmConfig

HAS_GAE = hasattr(ops, "packed_gae")
needs_gae = pytest.mark.skipif(
    not HAS_GAE,
    reason="areal_mega.ops.packed_gae has not landed on this branch yet (kernels engineer)",
)


def cfg_(**kw):
    return dataclasses.replace(AlgorithmConfig(), **kw)


# ----------------------------------------------------------------------------- shaping


def test_overlong_penalty_dapo():
    lens = torch.tensor([5, 6, 8, 10, 12])
    # L_exp = 10 - 4 = 6: 0 up to 6, then linear to -penalty at 10, -penalty beyond
    torch.testing.assert_close(
        overlong_penalty(lens, max_len=10, buffer=4), torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0])
    )
    torch.testing.assert_close(
        overlong_penalty(lens, max_len=10, buffer=4, penalty=0.5),
        torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]),
    )
    assert not overlong_penalty(lens, max_len=10, buffer=0).any()
    with pytest.raises(ValueError):
        overlong_penalty(lens, max_len=10, buffer=11)


def test_shape_rewards_order():
    cfg = cfg_(
        zero_reward_without_eos=True,
        overlong_buffer=4,
        reward_scale=2.0,
        reward_bias=-1.0,
        reward_clip=1.5,
    )
    r = shape_rewards(
        torch.tensor([1.0, 1.0, 0.0, 1.0]),
        cfg,
        response_lens=torch.tensor([3, 10, 8, 5]),
        seq_no_eos=torch.tensor([False, True, False, False]),
        max_response_len=10,
    )
    # no-EOS zero: [1,0,0,1]; + overlong [0,-1,-.5,0]; *2-1: [1,-3,-2,1]; clip ±1.5
    torch.testing.assert_close(r, torch.tensor([1.0, -1.5, -1.5, 1.0]))
    assert torch.equal(shape_rewards(torch.tensor([0.5, 2.0]), cfg_()), torch.tensor([0.5, 2.0]))
    with pytest.raises(KeyError):
        shape_rewards(torch.tensor([1.0]), cfg_(zero_reward_without_eos=True))


# ----------------------------------------------------------------------------- normalisation

R = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 5.0])
G = torch.tensor([7, 3, 7, 3, 7, 3, 7, 3, 9])  # interleaved groups; group 9 is a singleton
# group 7 = [1,0,0,1]: mean .5, unbiased std sqrt(1/3); group 3 = [1,1,1,0]: mean .75, std .5


def test_group_normalize_mean_std():
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        group_normalize(R, G),
        torch.tensor([a, 0.5, -a, 0.5, -a, 0.5, a, -1.5, 0.0]),
        atol=1e-5,
        rtol=1e-5,
    )


def test_group_normalize_std_free_and_leave_one_out():
    torch.testing.assert_close(
        group_normalize(R, G, use_std=False),
        torch.tensor([0.5, 0.25, -0.5, 0.25, -0.5, 0.25, 0.5, -0.75, 0.0]),
    )
    # RLOO: R_i - mean of the other three
    loo = group_normalize(R, G, use_std=False, leave_one_out=True)
    torch.testing.assert_close(
        loo,
        torch.tensor(
            [
                1 - 1 / 3,
                1 - 2 / 3,
                0 - 2 / 3,
                1 - 2 / 3,
                0 - 2 / 3,
                1 - 2 / 3,
                1 - 1 / 3,
                0 - 1.0,
                0.0,
            ]
        ),
    )
    loo_std = group_normalize(R, G, leave_one_out=True)
    torch.testing.assert_close(
        loo_std[[1, 7]], torch.tensor([(1 / 3) / 0.5, -1.0 / 0.5]), atol=1e-5, rtol=1e-5
    )


def test_group_normalize_uniform_group_is_zero():
    assert not group_normalize(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0])).any()


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1, 1, 1, 0])
    torch.testing.assert_close(
        masked_whiten(x, m), torch.tensor([-1.0, 0.0, 1.0, 0.0]), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        masked_whiten(x, m, shift_mean=False),
        torch.tensor([1.0, 2.0, 3.0, 0.0]),
        atol=1e-5,
        rtol=1e-5,
    )


def test_outcome_token_rewards_on_last_loss_token():
    cu = torch.tensor([0, 3, 6, 8], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 0, 0, 0])  # seq 1 ends with a masked tool token
    out = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask, cu)
    assert out.tolist() == [0, 0, 2.0, 0, 3.0, 0, 0, 0, 0]  # seq 2 has no loss token


# ----------------------------------------------------------------------------- compute_advantages


def grpo_batch():
    # 4 sequences of [prompt, generated]; token 8 is padding
    return {
        "cu_seqlens": torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32),
        "loss_mask": torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0]),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "group_index": torch.tensor([0, 0, 1, 1]),
        "logprobs": torch.tensor([0, -1.0, 0, -1.0, 0, -1.0, 0, -1.0, 0]),
        "ref_logprobs": torch.tensor([0, -1.2, 0, -1.4, 0, -1.0, 0, -0.8, 0]),
    }


def test_grpo_advantages():
    out, st = compute_advantages(grpo_batch(), cfg_())
    a = 0.5 / math.sqrt(0.5)  # group 0 = [1, 0]; group 1 is uniform -> 0
    torch.testing.assert_close(
        out["advantages"], torch.tensor([0, a, 0, -a, 0, 0, 0, 0, 0]), atol=1e-5, rtol=1e-5
    )
    assert st["reward_mean"] == 0.75 and "returns" not in out


def test_grpo_kl_in_reward_and_batch_norm():
    cfg = cfg_(kl_coef=0.5, kl_in_reward=True, kl_estimator="k1", group_std=False)
    out, st = compute_advantages(grpo_batch(), cfg)
    # k1 = behav - ref on loss tokens: [.2, .4, 0, -.2]; R - .5 k1 = [.9, -.2, 1, 1.1]
    torch.testing.assert_close(
        out["advantages"][[1, 3, 5, 7]], torch.tensor([0.55, -0.55, -0.05, 0.05])
    )
    assert st["kl_reward_mean"] == pytest.approx(0.1)
    out, _ = compute_advantages(grpo_batch(), dataclasses.replace(cfg, batch_norm=True))
    adv = out["advantages"][[1, 3, 5, 7]]
    assert float(adv.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(adv.std()) == pytest.approx(1.0, abs=1e-4)
    assert out["advantages"][[0, 2, 4, 6, 8]].abs().sum() == 0


def test_raw_rewards_without_group_norm_and_stats():
    b = dict(
        grpo_batch(),
        seq_no_eos=torch.tensor([False, False, True, False]),
        response_lens=torch.tensor([1, 1, 1, 1]),
    )
    out, st = compute_advantages(b, cfg_(group_norm=False, zero_reward_without_eos=True))
    assert out["advantages"][[1, 3, 5, 7]].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert st["no_eos_frac"] == 0.25 and st["shaped_reward_mean"] == 0.5


@needs_gae
def test_gae_advantages_hand_computed():
    # seq 0 terminated: [prompt, g, g]; seq 1 truncated: [prompt, g] bootstrapped with V=2;
    # token 5 is padding
    b = {
        "cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32),
        "loss_mask": torch.tensor([0, 1, 1, 0, 1, 0]),
        "rewards": torch.tensor([1.0, 1.0]),
        "values": torch.tensor([9.0, 0.5, 0.4, 9.0, 0.5, 9.0]),
        "bootstrap_values": torch.tensor([0.0, 2.0]),
    }
    out, _ = compute_advantages(b, cfg_(adv_estimator="gae", gamma=0.9, lam=0.8))
    # seq 0: last δ = 1 - .4 = .6; first δ = .9*.4 - .5 = -.14, A = -.14 + .72*.6 = .292
    # seq 1: δ = 1 + .9*2 - .5 = 2.3
    torch.testing.assert_close(out["advantages"], torch.tensor([0.0, 0.292, 0.6, 0, 2.3, 0]))
    torch.testing.assert_close(out["returns"], torch.tensor([0.0, 0.792, 1.0, 0, 2.8, 0]))


@needs_gae
def test_reinforce_returns_to_go():
    b = {
        "cu_seqlens": torch.tensor([0, 3], dtype=torch.int32),
        "loss_mask": torch.tensor([0, 1, 1]),
        "rewards": torch.tensor([1.0]),
    }
    out, _ = compute_advantages(b, cfg_(adv_estimator="reinforce", gamma=0.9, group_norm=False))
    torch.testing.assert_close(out["advantages"], torch.tensor([0.0, 0.9, 1.0]))


@needs_gae
def test_gae_without_values_is_a_clear_error():
    with pytest.raises(KeyError, match="values"):
        compute_advantages(grpo_batch(), cfg_(adv_estimator="gae"))


# ----------------------------------------------------------------------------- dynamic filter


def filter_batch():
    # 7 sequences of 2 tokens; groups 0 (all 1), 1 (mixed), 2 (all 0), 3 (singleton)
    return {
        "cu_seqlens": torch.arange(0, 15, 2, dtype=torch.int32),
        "loss_mask": torch.tensor([0, 1] * 7),
        "input_ids": torch.arange(14),
        "rewards": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]),
        "group_index": torch.tensor([0, 0, 1, 1, 2, 2, 3]),
    }


def test_uniform_groups():
    b = filter_batch()
    keep, uniform = uniform_groups(b["rewards"], b["group_index"])
    assert uniform.tolist() == [True, False, True, True]
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_dynamic_filter_drops_uniform_groups_with_stats():
    out, st = dynamic_filter(filter_batch(), enabled=True)
    assert out["input_ids"].tolist() == [4, 5, 6, 7]
    assert out["cu_seqlens"].tolist() == [0, 2, 4]
    assert out["rewards"].tolist() == [0.0, 1.0]
    assert st == {
        "groups": 4.0,
        "uniform_groups": 3.0,
        "uniform_group_frac": 0.75,
        "uniform_all_max_groups": 2.0,
        "uniform_all_min_groups": 1.0,
        "seqs_dropped": 5.0,
        "seqs_kept": 2.0,
    }
    b = filter_batch()
    same, st_off = dynamic_filter(b, enabled=False)
    assert same is b and st_off["uniform_groups"] == 3.0 and st_off["seqs_dropped"] == 0.0


# ----------------------------------------------------------------------------- conventions


def test_conventions_that_differ_from_verl_and_areal():
    """The choices docs/algorithms.md lists as deliberate differences, pinned on hand values."""
    # a singleton group: advantage 0 under every normalisation (verl: R/(1+eps); AReaL with
    # leave-one-out: R) ...
    one = torch.tensor([5.0]), torch.tensor([0])
    for kw in ({}, {"use_std": False}, {"leave_one_out": True}):
        assert float(group_normalize(*one, **kw)[0]) == 0.0
    # ... and the dynamic filter drops it (verl's DAPO filter keeps singletons)
    keep, _ = uniform_groups(torch.tensor([5.0, 1.0, 0.0]), torch.tensor([0, 1, 1]))
    assert keep.tolist() == [False, True, True]
    # reward: scale * r + bias (AReaL: (r + bias) * scale)
    r = shape_rewards(torch.tensor([1.0]), cfg_(reward_scale=2.0, reward_bias=1.0))
    assert float(r[0]) == 3.0
    # overlong penalty capped at -penalty beyond max_len (verl/AReaL: -(|y|-L_exp)/buffer·p)
    assert float(overlong_penalty(torch.tensor([20]), max_len=10, buffer=4, penalty=0.5)) == -0.5

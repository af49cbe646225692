"""Policy loss: hand-computed cases for every building block and option, gradients, stats."""

import dataclasses
import math

import pytest
import torch

from areal_mega.algo import (
    aggregate_loss,
    behav_importance_weight,
    clipped_surrogate,
    finalize_stats,
    loss_denominator,
    make_policy_loss,
    policy_loss,
    ppo_ratio,
)
from areal_mega.config import AlgorithmConfig

E = math.e


def cfg_(**kw):
    return dataclasses.replace(AlgorithmConfig(), **kw)


# ----------------------------------------------------------------------------- clipped surrogate

RATIO = torch.tensor([0.5, 1.1, 1.5, 0.7, 1.5, 4.0], dtype=torch.float64)
ADV = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)


def test_clipped_surrogate_clip_higher_hand_values():
    loss, clipped, dual = clipped_surrogate(RATIO, ADV, eps_low=0.2, eps_high=0.28)
    # A>0: max(-r, -clip(r,0.8,1.28)); A<0: max(r, clip(r,0.8,1.28))
    torch.testing.assert_close(
        loss, torch.tensor([-0.5, -1.1, -1.28, 0.8, 1.5, 4.0], dtype=torch.float64)
    )
    assert clipped.tolist() == [False, False, True, True, False, False]
    assert not dual.any()


def test_clipped_surrogate_symmetric_default():
    loss, clipped, _ = clipped_surrogate(torch.tensor([1.25]), torch.tensor([2.0]), eps_low=0.2)
    torch.testing.assert_close(loss, torch.tensor([-2.4]))  # -2 * 1.2
    assert clipped.tolist() == [True]


def test_dual_clip_bounds_negative_advantage_loss():
    loss, clipped, dual = clipped_surrogate(RATIO, ADV, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    torch.testing.assert_close(
        loss, torch.tensor([-0.5, -1.1, -1.28, 0.8, 1.5, 3.0], dtype=torch.float64)
    )
    assert dual.tolist() == [False] * 5 + [True]
    with pytest.raises(ValueError):
        clipped_surrogate(RATIO, ADV, eps_low=0.2, dual_clip_c=1.0)


def test_clipped_surrogate_gradients():
    logp = torch.log(RATIO).requires_grad_()
    loss, _, _ = clipped_surrogate(
        torch.exp(logp), ADV, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0
    )
    loss.sum().backward()
    # d(-A r)/dlogp = -A r on unclipped tokens, 0 where clipped or dual-clipped
    torch.testing.assert_close(
        logp.grad, torch.tensor([-0.5, -1.1, 0.0, 0.0, 1.5, 0.0], dtype=torch.float64)
    )


# ----------------------------------------------------------------------------- ratio / weights

CU = torch.tensor([0, 2, 4], dtype=torch.int32)


def test_token_and_sequence_ratio():
    old = torch.zeros(5, dtype=torch.float64)
    logp = torch.tensor([0.1, 0.3, 0.5, 9.0, 7.0], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([1, 1, 1, 0, 0])
    tok = ppo_ratio(logp, old, mask, CU, "token")
    torch.testing.assert_close(
        tok,
        torch.tensor([math.exp(0.1), math.exp(0.3), math.exp(0.5), 1.0, 1.0], dtype=torch.float64),
    )
    seq = ppo_ratio(logp, old, mask, CU, "sequence")  # GSPO: exp(mean log-ratio) per sequence
    torch.testing.assert_close(
        seq,
        torch.tensor([math.exp(0.2), math.exp(0.2), math.exp(0.5), 1.0, 1.0], dtype=torch.float64),
    )
    seq.sum().backward()
    # d/dlogp_t of 2*exp(mean(d0,d1)) = exp(0.2); seq 1 has one loss token: exp(0.5)
    torch.testing.assert_close(
        logp.grad,
        torch.tensor([math.exp(0.2), math.exp(0.2), math.exp(0.5), 0, 0], dtype=torch.float64),
    )


def test_importance_weight_token_mask_and_clamp():
    behav = torch.zeros(4)
    prox = torch.tensor([0.1, -0.2, 2.0, 3.0])
    mask = torch.tensor([1, 1, 1, 0])
    w, keep, capped = behav_importance_weight(prox, behav, mask, cap=5.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([math.exp(0.1), math.exp(-0.2), math.exp(2.0), 1.0]))
    assert keep.tolist() == [True, True, False, False]  # e^2 = 7.39 > 5 dropped
    assert capped.tolist() == [False, False, True, False]
    w, keep, capped = behav_importance_weight(prox, behav, mask, cap=5.0, mode="clamp")
    torch.testing.assert_close(w, torch.tensor([math.exp(0.1), math.exp(-0.2), 5.0, 1.0]))
    assert keep.tolist() == [True, True, True, False]
    assert capped.tolist() == [False, False, True, False]
    w, keep, capped = behav_importance_weight(prox, behav, mask, cap=None)
    assert keep.tolist() == [True, True, True, False] and not capped.any()
    assert float(w[2]) == pytest.approx(math.exp(2.0))


def test_importance_weight_sequence_and_geometric():
    behav = torch.zeros(5)
    prox = torch.tensor([0.5, 0.6, 1.0, 0.7, 4.0])  # token 4 is padding
    mask = torch.tensor([1, 1, 1, 1, 0])
    w, keep, _ = behav_importance_weight(prox, behav, mask, CU, cap=5.0, level="sequence")
    # seq 0: e^{1.1} = 3.00 kept; seq 1: e^{1.7} = 5.47 > 5: the whole sequence is masked
    torch.testing.assert_close(w, torch.tensor([math.exp(1.1)] * 2 + [math.exp(1.7)] * 2 + [1.0]))
    assert keep.tolist() == [True, True, False, False, False]
    w, keep, _ = behav_importance_weight(prox, behav, mask, CU, cap=5.0, level="geometric")
    torch.testing.assert_close(w, torch.tensor([math.exp(0.55)] * 2 + [math.exp(0.85)] * 2 + [1.0]))
    assert keep.tolist() == [True, True, True, True, False]
    w, _, capped = behav_importance_weight(
        prox, behav, mask, CU, cap=5.0, level="sequence", mode="clamp"
    )
    torch.testing.assert_close(w[2:4], torch.tensor([5.0, 5.0]))
    assert capped.tolist() == [False, False, True, True, False]


# ----------------------------------------------------------------------------- aggregation


def test_aggregation_and_denominators():
    # seq 0 = tokens 0..2 (3 loss tokens), seq 1 = tokens 3..4 (1 loss token), seq 2 has none
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    mask = torch.tensor([1, 1, 1, 0, 1, 0, 0])
    tl = torch.tensor([1.0, 2.0, 3.0, 100.0, 4.0, 100.0, 100.0])
    assert float(aggregate_loss(tl, mask, cu, "token_mean")) == pytest.approx(10.0)
    assert float(aggregate_loss(tl, mask, cu, "seq_mean")) == pytest.approx(2.0 + 4.0)
    assert float(aggregate_loss(tl, mask, cu, "seq_sum_norm", 8)) == pytest.approx(10 / 8)
    assert float(loss_denominator(mask, cu, "token_mean")) == 4
    assert float(loss_denominator(mask, cu, "seq_mean")) == 2  # seq 2 has no loss token
    assert float(loss_denominator(mask, cu, "seq_sum_norm")) == 2
    with pytest.raises(ValueError):
        aggregate_loss(tl, mask, cu, "seq_sum_norm")
    with pytest.raises(ValueError):
        loss_denominator(mask, cu, "bogus")


# ----------------------------------------------------------------------------- the full loss


def hand_mb():
    """seq 0: tokens 0,1 (both trained); seq 1: token 2 prompt, token 3 trained; token 4 pad."""
    return {
        "cu_seqlens": torch.tensor([0, 2, 4], dtype=torch.int32),
        "loss_mask": torch.tensor([1, 1, 0, 1, 0], dtype=torch.uint8),
        "prox_logprobs": torch.tensor([-1.1, -2.0, 0.0, -1.0, 0.0]),
        "logprobs": torch.tensor([-1.2, -3.0, 0.0, -1.0, 0.0]),
        "advantages": torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0]),
    }


LOGP = [-1.0, -2.0, -0.5, -1.5, 0.0]


@pytest.mark.parametrize(
    "agg,num,den",
    [
        ("token_mean", -math.exp(0.2) + 0.8, 3),
        ("seq_mean", -math.exp(0.2) / 2 + 0.8, 2),
        ("seq_sum_norm", (-math.exp(0.2) + 0.8) / 4, 2),
    ],
)
def test_decoupled_loss_hand_computed(agg, num, den):
    # ratio vs prox: [e^.1, 1, -, e^-.5]; weight prox/behav: [e^.1, e (> cap 2: masked), -, 1]
    # token 0: -A r w = -e^.2; token 1 masked; token 3: A=-1, r=0.607 -> clipped at 0.8
    cfg = cfg_(eps_clip_low=0.2, behav_imp_weight_cap=2.0, loss_agg=agg, loss_norm_len=4)
    loss_fn, den_fn = make_policy_loss(cfg)
    logp = torch.tensor(LOGP, requires_grad=True)
    numerator, stats = loss_fn(logp, None, hand_mb())
    assert float(numerator.detach()) == pytest.approx(num, rel=1e-6)
    assert den_fn(hand_mb()) == den
    numerator.backward()
    scale = {"token_mean": 1.0, "seq_mean": 0.5, "seq_sum_norm": 0.25}[agg]
    torch.testing.assert_close(logp.grad, torch.tensor([-math.exp(0.2) * scale, 0, 0, 0, 0]))
    s = {k: float(v) for k, v in stats.items()}
    assert s["token_count"] == 3 and s["seq_count"] == 2
    assert s["clip_count"] == 1 and s["dual_clip_count"] == 0
    assert s["imp_weight_capped_count"] == 1
    assert s["ppo_kl_sum"] == pytest.approx(-0.1 + 0.0 + 0.5, abs=1e-6)  # Σ prox - logp
    assert s["behav_kl_sum"] == pytest.approx(-0.2 - 1.0 + 0.5, abs=1e-6)  # Σ behav - logp
    assert s["mismatch_sum"] == pytest.approx(0.1 + 1.0 + 0.0, abs=1e-6)  # Σ |prox - behav|
    assert s["imp_weight_sum"] == pytest.approx(math.exp(0.1) + E + 1, rel=1e-6)
    assert s["ratio_sum"] == pytest.approx(math.exp(0.1) + 1 + math.exp(-0.5), rel=1e-6)
    assert s["pg_loss_sum"] == pytest.approx(-math.exp(0.2) + 0.8, rel=1e-6)
    assert s["advantage_sum"] == pytest.approx(1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_prox_from_the_forward_equals_passing_the_same_logprobs(level):
    """make_policy_loss(prox_from_forward=True) with no prox_logprobs: π_prox is π_θ detached,
    i.e. what a separate forward on the same weights attaches; the gradient flows through
    π_θ only."""
    cfg = cfg_(ratio_level=level, policy_loss="gspo" if level == "sequence" else "ppo")
    mb = hand_mb()
    del mb["prox_logprobs"]
    logp = torch.tensor(LOGP, requires_grad=True)
    num, stats = make_policy_loss(cfg, prox_from_forward=True)[0](logp, None, mb)
    num.backward()
    want_lp = torch.tensor(LOGP, requires_grad=True)
    want, want_stats = policy_loss(want_lp, None, dict(mb, prox_logprobs=want_lp.detach()), cfg)
    want.backward()
    assert float(num.detach()) == float(want.detach()) and torch.equal(logp.grad, want_lp.grad)
    assert {k: float(v) for k, v in stats.items()} == {k: float(v) for k, v in want_stats.items()}
    assert float(stats["ratio_sum"]) == float(stats["token_count"])  # ratio exactly 1
    with pytest.raises(KeyError, match="prox_logprobs"):
        make_policy_loss(cfg)[0](logp, None, mb)


def test_the_trainer_skips_the_proximal_forward_only_where_nothing_else_needs_it():
    from areal_mega.config import load_config
    from areal_mega.trainer import prox_forward_needed

    def needed(step=1, n_updates=1, **keys):
        cfg = load_config(None, [f"{k.replace('__', '.')}={v}" for k, v in keys.items()])
        return prox_forward_needed(cfg, step, n_updates)

    assert not needed() and not needed(n_updates=0)  # one update, or none at all
    assert needed(n_updates=2)  # later minibatches moved
    assert needed(actor__prox_logprobs="recompute")
    assert needed(algorithm__opd="pure", teacher__path="/t", algorithm__dynamic_filter="false")
    assert needed(
        algorithm__adv_estimator="gae",
        critic__enabled="true",
        algorithm__kl_in_reward="true",
        algorithm__kl_coef=0.1,
        ref__enabled="true",
    )
    replay = dict(algorithm__routing_replay="r3", algorithm__routing_replay_free_every=2)
    assert needed(step=1, **replay) and not needed(step=2, **replay)


def test_standard_ppo_uses_behaviour_policy():
    cfg = cfg_(decoupled=False, eps_clip_low=0.2)
    mb = hand_mb()
    del mb["prox_logprobs"]
    logp = torch.tensor(LOGP, requires_grad=True)
    num, stats = policy_loss(logp, None, mb, cfg)
    # ratio vs behav: [e^.2 = 1.22, e^1, -, e^-.5]: A>0 tokens clipped at 1.2, A<0 at 0.8
    assert float(num.detach()) == pytest.approx(-1.2 - 1.2 + 0.8, rel=1e-6)
    assert float(stats["clip_count"]) == 3
    assert float(stats["imp_weight_sum"]) == 3  # no importance weight: all ones
    assert float(stats["ppo_kl_sum"]) == pytest.approx(-0.7, abs=1e-6)
    with pytest.raises(KeyError):
        policy_loss(logp, None, mb, cfg_(decoupled=True))


def test_kl_loss_term_and_entropy_bonus():
    mb = hand_mb()
    mb["advantages"] = torch.zeros(5)
    mb["ref_logprobs"] = torch.tensor([-1.5, -1.0, 0.0, -1.5, 0.0])
    cfg = cfg_(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    logp = torch.tensor(LOGP, requires_grad=True)
    ent = torch.tensor([2.0, 3.0, 9.0, 1.0, 9.0])
    num, stats = policy_loss(logp, ent, mb, cfg)
    d = torch.tensor([0.5, -1.0, 0.0])  # logp - ref on the 3 loss tokens
    k3 = torch.exp(-d) - 1 + d
    assert float(num.detach()) == pytest.approx(0.1 * float(k3.sum()) - 0.01 * 6.0, rel=1e-6)
    assert float(stats["kl_ref_sum"]) == pytest.approx(float(k3.sum()), rel=1e-6)
    assert float(stats["entropy_sum"]) == pytest.approx(6.0)
    num.backward()
    g = 0.1 * (1 - torch.exp(-d))  # d k3 / d logp = 1 - e^{-d}
    torch.testing.assert_close(logp.grad, torch.tensor([g[0], g[1], 0, g[2], 0]))
    # KL in the reward: the loss carries no KL term, the stat is still reported
    num2, stats2 = policy_loss(logp, None, mb, cfg_(kl_coef=0.1, kl_in_reward=True))
    assert float(num2.detach()) == 0.0 and "kl_ref_sum" in stats2
    del mb["ref_logprobs"]
    with pytest.raises(KeyError):
        policy_loss(logp, None, mb, cfg_(kl_coef=0.1))


def test_gspo_sequence_ratio_in_loss():
    cfg = cfg_(
        ratio_level="sequence", eps_clip_low=0.2, behav_imp_weight_cap=None, loss_agg="seq_mean"
    )
    mb = hand_mb()
    mb["logprobs"] = mb["prox_logprobs"].clone()
    logp = torch.tensor(LOGP, requires_grad=True)
    num, _ = policy_loss(logp, None, mb, cfg)
    # seq 0: s = exp(mean(0.1, 0)) = e^.05, A=1 -> -e^.05 (per token, mean over tokens)
    # seq 1: s = e^-.5, A=-1 -> clipped at 0.8
    assert float(num.detach()) == pytest.approx(-math.exp(0.05) + 0.8, rel=1e-6)
    num.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-math.exp(0.05) / 2] * 2 + [0, 0, 0]))


def test_make_policy_loss_needs_norm_len_for_dr_grpo():
    with pytest.raises(ValueError, match="loss_norm_len"):
        make_policy_loss(cfg_(loss_agg="seq_sum_norm"))
    loss_fn, _ = make_policy_loss(cfg_(loss_agg="seq_sum_norm"), max_response_len=4)
    num, _ = loss_fn(torch.tensor(LOGP), None, hand_mb())
    cfg_num, _ = make_policy_loss(cfg_(loss_agg="seq_sum_norm", loss_norm_len=4))[0](
        torch.tensor(LOGP), None, hand_mb()
    )
    assert float(num.detach()) == float(cfg_num)


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"ratio_level": "sequence", "imp_weight_level": "sequence"},
        {"imp_weight_level": "geometric", "imp_weight_mode": "clamp", "dual_clip_c": 3.0},
        {"decoupled": False, "loss_agg": "seq_mean"},
    ],
)
def test_on_policy_identity(kw):
    """π_θ = π_prox = π_behav: ratio and weight exactly 1, no clipping, ppo_kl and mismatch 0."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    mask = (torch.rand(18, generator=g) > 0.3).to(torch.uint8)
    mask[16:] = 0
    lp = -torch.rand(18, generator=g) * 3
    mb = {
        "cu_seqlens": cu,
        "loss_mask": mask,
        "prox_logprobs": lp.clone(),
        "logprobs": lp.clone(),
        "advantages": torch.randn(18, generator=g) * 5,
    }
    logp = lp.clone().requires_grad_()
    num, stats = policy_loss(logp, None, mb, cfg_(**kw))
    out = finalize_stats(stats)
    n = float(mask.sum())
    assert out["token_count"] == n
    assert out["ratio"] == 1.0 and out["imp_weight"] == 1.0 and out["imp_weight_std"] == 0.0
    assert out["clip_frac"] == 0.0 and out["dual_clip_frac"] == 0.0
    assert out["imp_weight_capped_frac"] == 0.0
    assert out["ppo_kl"] == 0.0 and out["behav_kl"] == 0.0 and out["mismatch"] == 0.0
    num.backward()
    # at ratio 1 the gradient is the plain policy gradient -A (per token, for token_mean)
    if kw.get("loss_agg", "token_mean") == "token_mean" and kw.get("ratio_level") != "sequence":
        torch.testing.assert_close(logp.grad, -mb["advantages"] * mask)


def test_finalize_stats_means_fracs_std():
    out = finalize_stats(
        {
            "token_count": torch.tensor(4.0),
            "seq_count": 2.0,
            "clip_count": 1.0,
            "ppo_kl_sum": 2.0,
            "imp_weight_sum": 4.4,
            "imp_weight_sq_sum": 5.0,
        }
    )
    assert out["token_count"] == 4 and out["seq_count"] == 2
    assert out["clip_frac"] == 0.25 and out["ppo_kl"] == 0.5
    assert out["imp_weight"] == pytest.approx(1.1)
    assert out["imp_weight_std"] == pytest.approx(math.sqrt(5.0 / 4 - 1.21))
    assert "clip_frac" not in finalize_stats({"token_count": 0.0, "clip_count": 0.0})


def test_gradcheck_full_loss():
    """Analytic vs numerical gradient (float64) through ratio, weights, GSPO, KL and agg."""
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0], dtype=torch.uint8)
    prox = -torch.rand(11, generator=g, dtype=torch.float64) - 0.5
    mb = {
        "cu_seqlens": cu,
        "loss_mask": mask,
        "prox_logprobs": prox,
        "logprobs": prox + 0.05 * torch.randn(11, generator=g, dtype=torch.float64),
        "ref_logprobs": prox + 0.3 * torch.randn(11, generator=g, dtype=torch.float64),
        "advantages": torch.randn(11, generator=g, dtype=torch.float64),
    }
    logp = (prox + 0.05 * torch.randn(11, generator=g, dtype=torch.float64)).requires_grad_()
    for kw in [
        {"loss_agg": "token_mean", "kl_coef": 0.2},
        {"loss_agg": "seq_mean", "ratio_level": "sequence", "kl_estimator": "k2", "kl_coef": 0.1},
        {"loss_agg": "seq_sum_norm", "loss_norm_len": 5, "imp_weight_level": "sequence"},
    ]:
        loss_fn, _ = make_policy_loss(cfg_(**kw))
        assert torch.autograd.gradcheck(lambda x: loss_fn(x, None, mb)[0], (logp,))  # noqa: B023


def test_mismatch_counts_only_tokens_of_the_evaluated_weights():
    """|prox - behav| over loss tokens whose version is the trainer's policy version; the same
    difference over all loss tokens (mismatch + policy lag) is ``behav_diff``."""
    mb = hand_mb()
    mb["versions"] = torch.tensor([3, 2, -1, 3, -1], dtype=torch.int32)
    mb["policy_version"] = 3
    lp = torch.tensor(LOGP, requires_grad=True)
    _, st = policy_loss(lp, None, mb, cfg_())
    out = finalize_stats(st)
    # version-3 loss tokens: 0 (|-1.1+1.2| = 0.1) and 3 (|-1.0+1.0| = 0)
    assert out["mismatch_tokens"] == 2
    assert out["mismatch"] == pytest.approx(0.1 / 2)
    # all loss tokens 0, 1, 3: (0.1 + 1.0 + 0) / 3
    assert out["behav_diff"] == pytest.approx(1.1 / 3)
    # without versions every loss token counts
    _, st = policy_loss(lp, None, hand_mb(), cfg_())
    assert finalize_stats(st)["mismatch"] == pytest.approx(1.1 / 3)


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_agg": "seq_mean"},
        {"ratio_level": "sequence", "imp_weight_level": "geometric"},
        {"imp_weight_level": "sequence", "loss_agg": "seq_sum_norm", "loss_norm_len": 8},
    ],
)
def test_loss_on_a_cp_padded_batch_uses_the_slot_layout(kw):
    """Packed for context parallelism (slots padded to 2·CP), sequences live at
    ``cu_seqlens_padded``: loss, denominator and statistics equal those of the unpadded pack."""
    from areal_mega.scheduler.packing import pack_sequences

    g = torch.Generator().manual_seed(3)
    seqs = []
    for n in (9, 14, 5):
        prox = -torch.rand(n, generator=g)
        seqs.append(
            {
                "input_ids": torch.zeros(n, dtype=torch.long),
                "prompt_len": 2,
                "advantages": torch.randn(n, generator=g),
                "prox_logprobs": prox,
                "logprobs": prox + 0.3 * torch.randn(n, generator=g),
                "lp": prox + 0.1 * torch.randn(n, generator=g),
            }
        )
    loss_fn, den_fn = make_policy_loss(cfg_(**kw))
    out = []
    for cp in (1, 2):
        mb = pack_sequences(seqs, pad_to_multiple=4, cp_size=cp)
        num, st = loss_fn(mb["lp"], None, mb)
        out.append((float(num), den_fn(mb), {k: float(v) for k, v in st.items()}))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6) and out[0][1] == out[1][1]
    assert out[0][2] == pytest.approx(out[1][2], rel=1e-6)

"""The engine loss contract is split-invariant: the same batch as 1, 2 or 4 micro-batches, on
1 or 2 DP ranks, gives the same loss, gradients and summed statistics.

Simulation of the engine: loss = Σ_mb loss_fn(mb).numerator / Σ_{mb, ranks} denominator_fn(mb),
the denominator being known before any forward pass; each DP rank backpropagates its own
numerators over the shared global denominator and the gradients are summed across ranks.
"""

import dataclasses

import pytest
import torch

from areal_mega.algo import finalize_stats, make_policy_loss, select_sequences
from areal_mega.algo.packing import split_micro_batches
from areal_mega.config import AlgorithmConfig

CONFIGS = {
    "token_mean": {},
    "seq_mean": {"loss_agg": "seq_mean"},
    "dr_grpo": {"loss_agg": "seq_sum_norm", "loss_norm_len": 16, "group_std": False},
    "gspo": {
        "loss_agg": "seq_mean",
        "ratio_level": "sequence",
        "eps_clip_low": 3e-4,
        "eps_clip_high": 4e-4,
    },
    "seq_is_mask_dual": {
        "imp_weight_level": "sequence",
        "behav_imp_weight_cap": 1.2,
        "dual_clip_c": 1.3,
        "eps_clip_high": 0.28,
    },
    "geo_clamp_kl_ent": {
        "imp_weight_level": "geometric",
        "imp_weight_mode": "clamp",
        "behav_imp_weight_cap": 1.05,
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
    },
}


def make_batch(seed=0, n_seqs=8, pad=5):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 12, (n_seqs,), generator=g)
    cu = torch.zeros(n_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    T = int(cu[-1]) + pad
    mask = torch.zeros(T, dtype=torch.uint8)
    for b in range(n_seqs):  # a 2-token prompt, then generated tokens (some masked out)
        s, e = int(cu[b]), int(cu[b + 1])
        mask[s + 2 : e] = (torch.rand(e - s - 2, generator=g) > 0.15).to(torch.uint8)
    prox = -torch.rand(T, generator=g, dtype=torch.float64) * 2 - 0.1
    adv_seq = torch.randn(n_seqs, generator=g, dtype=torch.float64)
    adv = torch.cat([torch.repeat_interleave(adv_seq, lens), torch.zeros(pad, dtype=torch.float64)])
    return {
        "cu_seqlens": cu,
        "loss_mask": mask,
        "input_ids": torch.arange(T),
        "prox_logprobs": prox,
        "logprobs": prox + 0.2 * torch.randn(T, generator=g, dtype=torch.float64),
        "ref_logprobs": prox + 0.3 * torch.randn(T, generator=g, dtype=torch.float64),
        "advantages": adv,
        "logprobs0": prox + 0.3 * torch.randn(T, generator=g, dtype=torch.float64),
        "entropy": torch.rand(T, generator=g, dtype=torch.float64) * 3,
        "rewards": adv_seq.clone(),
        "group_index": torch.arange(n_seqs) // 4,
    }


def run_rank(loss_fn, mbs, logp_full, global_den):
    """One DP rank: Σ its numerators / the global denominator; returns (loss, summed stats)."""
    loss = 0.0
    stats = {}
    for mb in mbs:
        num, st = loss_fn(mb["policy_logprobs"], mb["entropy"], mb)
        loss = loss + num
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + float(v)
    return loss / global_den, stats


def simulate(cfg, batch, n_dp, n_mb):
    loss_fn, den_fn = make_policy_loss(cfg)
    logp = batch["logprobs0"].clone().requires_grad_()
    # π_θ rides along as a per-token field so micro-batches gather it (``logprobs`` is the
    # behaviour field of the batch vocabulary)
    full = dict(batch, policy_logprobs=logp)
    ranks = split_micro_batches(full, n_dp)
    mbs_per_rank = [split_micro_batches(r, n_mb) for r in ranks]
    global_den = sum(den_fn(mb) for mbs in mbs_per_rank for mb in mbs)  # before any forward
    total_loss, stats = 0.0, {}
    for mbs in mbs_per_rank:
        loss, st = run_rank(loss_fn, mbs, logp, global_den)
        loss.backward()  # grads of all ranks accumulate = all-reduce SUM
        total_loss += float(loss.detach())
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v
    return total_loss, logp.grad.clone(), finalize_stats(stats)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_invariance(name):
    cfg = dataclasses.replace(AlgorithmConfig(), **CONFIGS[name])
    batch = make_batch()
    ref_loss, ref_grad, ref_stats = simulate(cfg, batch, n_dp=1, n_mb=1)
    assert ref_grad.abs().sum() > 0 and ref_loss != 0.0
    for n_dp, n_mb in [(1, 2), (1, 4), (2, 1), (2, 2)]:
        loss, grad, stats = simulate(cfg, batch, n_dp, n_mb)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-14), (n_dp, n_mb)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
        for k, v in ref_stats.items():
            assert stats[k] == pytest.approx(v, rel=1e-12, abs=1e-14), k


def test_options_are_exercised():
    """The invariance test is meaningful: clipping, capping and dual clipping all happen."""
    batch = make_batch()
    _, _, st = simulate(
        dataclasses.replace(AlgorithmConfig(), **CONFIGS["seq_is_mask_dual"]), batch, 1, 1
    )
    assert 0 < st["imp_weight_capped_frac"] < 1 and st["clip_frac"] > 0
    assert st["dual_clip_frac"] > 0
    _, _, st = simulate(dataclasses.replace(AlgorithmConfig(), **CONFIGS["gspo"]), batch, 1, 1)
    assert 0 < st["clip_frac"] < 1


def test_token_mean_equals_unsplit_formula():
    """Σ numerators / Σ denominators is the plain mean over all loss tokens of the batch."""
    cfg = AlgorithmConfig(behav_imp_weight_cap=None)
    batch = make_batch(seed=3)
    loss, _, _ = simulate(cfg, batch, 2, 2)
    m = batch["loss_mask"].bool()
    r = torch.exp(batch["logprobs0"] - batch["prox_logprobs"])
    w = torch.exp(batch["prox_logprobs"] - batch["logprobs"])
    A = batch["advantages"]
    tok = w * torch.maximum(-A * r, -A * r.clamp(0.8, 1.2))
    assert loss == pytest.approx(float(tok[m].mean()), rel=1e-12)


def test_select_sequences_regathers_fields():
    batch = make_batch(n_seqs=3, pad=2)
    cu = batch["cu_seqlens"].tolist()
    out = select_sequences(batch, [2, 0])
    assert out["cu_seqlens"].tolist() == [0, cu[3] - cu[2], cu[3] - cu[2] + cu[1]]
    assert out["input_ids"].tolist() == list(range(cu[2], cu[3])) + list(range(0, cu[1]))
    assert out["rewards"].tolist() == batch["rewards"][[2, 0]].tolist()
    assert out["group_index"].tolist() == [0, 0]
    with pytest.raises(ValueError, match="leading dim"):
        select_sequences(dict(batch, odd=torch.zeros(2)), [0])


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_empty_padding_only_micro_batch(agg):
    """The scheduler may hand a rank a padding-only micro-batch (B = 0): zero numerator and
    denominator, but still a graph to backpropagate through."""
    cfg = dataclasses.replace(
        AlgorithmConfig(),
        loss_agg=agg,
        loss_norm_len=8,
        ratio_level="sequence",
        imp_weight_level="sequence",
    )
    loss_fn, den_fn = make_policy_loss(cfg)
    mb = {
        "cu_seqlens": torch.zeros(1, dtype=torch.int32),
        "loss_mask": torch.zeros(4),
        "logprobs": torch.zeros(4),
        "prox_logprobs": torch.zeros(4),
        "advantages": torch.zeros(4),
    }
    logp = torch.zeros(4, requires_grad=True)
    num, stats = loss_fn(logp, None, mb)
    assert den_fn(mb) == 0.0 and float(num.detach()) == 0.0
    num.backward()
    assert logp.grad is not None and not logp.grad.any()
    assert finalize_stats(stats)["token_count"] == 0.0

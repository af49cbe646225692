"""Policy objectives (``algorithm.policy_loss``): CISPO and SAPO in closed form, and PPO / CISPO /
SAPO against verl's own functions.

verl is not installed here: ``tests/data/verl_loss_table.json`` is a frozen table written by
``tests/data/make_verl_loss_table.py`` running verl's ``compute_policy_loss_vanilla`` /
``_cispo`` / ``_sapo`` (the commit is recorded in the table). Same aggregation on both sides:
verl ``token-mean`` <-> our ``token_mean``, ``seq-mean-token-mean`` <-> ``seq_mean``; the
decoupled cases hand verl our behaviour weight π_prox/π_behav as ``rollout_is_weights``.
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from areal_mega.algo.objectives import cispo_surrogate, sapo_gate, sapo_surrogate
from areal_mega.algo.policy_loss import make_policy_loss
from areal_mega.config import AlgorithmConfig

TABLE = json.loads((Path(__file__).parent / "data" / "verl_loss_table.json").read_text())
TOL = 1e-6


def cfg_(**kw):
    return dataclasses.replace(AlgorithmConfig(), **kw)


# ----------------------------------------------------------------------------- closed forms


def test_cispo_closed_form_value_gradient_and_clip_mask():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    ratio = torch.tensor([0.5, 1.0, 2.0, 1.1], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    loss, clipped = cispo_surrogate(logp, ratio, adv, eps_low=0.2, eps_high=0.28)
    w = torch.tensor([0.8, 1.0, 1.28, 1.1], dtype=torch.float64)
    assert torch.allclose(loss, -w * adv * logp.detach())
    assert clipped.tolist() == [True, False, True, False]
    loss.sum().backward()
    assert torch.allclose(logp.grad, -w * adv)  # clipped tokens keep a gradient
    assert ratio.grad is None  # the weight is detached


def test_sapo_gate_is_one_with_slope_one_on_policy():
    r = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    for tau in (0.5, 1.0, 1.05, 4.0):
        g = sapo_gate(r, torch.tensor(tau, dtype=torch.float64)).sum()
        (grad,) = torch.autograd.grad(g, r)
        assert abs(g.item() - 2.0 / tau) < 1e-12  # σ(0) = 1/2: value 2/τ
        assert abs(float(grad) - 1.0) < 1e-12  # slope (4/τ)·τ·σ'(0) = 1


def test_sapo_temperature_by_advantage_sign():
    ratio = torch.tensor([1.5, 1.5, 1.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    loss = sapo_surrogate(ratio, adv, tau_pos=1.0, tau_neg=2.0)
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    assert abs(float(loss[0]) + 4.0 * sig(0.5)) < 1e-12
    assert abs(float(loss[1]) - 2.0 * sig(1.0)) < 1e-12
    assert float(loss[2]) == 0.0
    with pytest.raises(ValueError, match="tau"):
        sapo_surrogate(ratio, adv, tau_pos=0.0, tau_neg=1.0)


def test_gspo_policy_loss_equals_ppo_with_sequence_ratio():
    g = torch.Generator().manual_seed(0)
    mb = {
        "loss_mask": torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool),
        "cu_seqlens": torch.tensor([0, 3, 6]),
        "advantages": torch.randn(6, generator=g, dtype=torch.float64),
        "logprobs": -torch.rand(6, generator=g, dtype=torch.float64),
    }
    mb["prox_logprobs"] = mb["logprobs"] + 0.1
    logp = mb["logprobs"] + 0.3 * torch.randn(6, generator=g, dtype=torch.float64)
    a, _ = make_policy_loss(cfg_(policy_loss="gspo", ratio_level="sequence"))[0](logp, None, mb)
    b, _ = make_policy_loss(cfg_(policy_loss="ppo", ratio_level="sequence"))[0](logp, None, mb)
    c, _ = make_policy_loss(cfg_(policy_loss="ppo"))[0](logp, None, mb)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_unknown_policy_loss_is_refused():
    with pytest.raises(ValueError, match="policy_loss"):
        make_policy_loss(cfg_(policy_loss="trpo"))


# ----------------------------------------------------------------------------- against verl


def _packed(inp: dict):
    """The table's padded [B, L] batch as our packed layout (row i cut to its length)."""
    lengths = inp["lengths"]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))

    def pack(key, dtype=torch.float64):
        return torch.cat([torch.tensor(row[:n], dtype=dtype) for row, n in zip(inp[key], lengths)])

    mb = {
        "loss_mask": pack("mask", torch.bool),
        "cu_seqlens": cu,
        "advantages": pack("advantages"),
        "logprobs": pack("behav_logprobs"),
        "prox_logprobs": pack("prox_logprobs"),
    }
    return mb, pack("logprobs")


def test_table_is_from_verl_and_covers_every_objective():
    assert len(TABLE["verl_commit"]) == 40
    assert {c["objective"] for c in TABLE["cases"]} == {"ppo", "cispo", "sapo"}
    assert {c["loss_agg"] for c in TABLE["cases"]} == {"token_mean", "seq_mean"}
    assert any(c["clipfrac"] > 0 for c in TABLE["cases"])  # the clip binds somewhere


@pytest.mark.parametrize(
    "case",
    TABLE["cases"],
    ids=lambda c: (
        f"{c['objective']}-{c['loss_agg']}-in{c['inputs']}-{'dec' if c['decoupled'] else 'onp'}"
    ),
)
def test_matches_verl(case):
    p = TABLE["params"]
    inp = TABLE["inputs"][case["inputs"]]
    cfg = cfg_(
        policy_loss=case["objective"],
        eps_clip_low=p["eps_low"],
        eps_clip_high=p["eps_high"],
        dual_clip_c=p["dual_clip_c"] if case["objective"] == "ppo" else None,
        sapo_tau_pos=p["tau_pos"],
        sapo_tau_neg=p["tau_neg"],
        decoupled=case["decoupled"],
        behav_imp_weight_cap=None,
        loss_agg=case["loss_agg"],
    )
    mb, logp = _packed(inp)
    logp.requires_grad_(True)
    loss_fn, denominator_fn = make_policy_loss(cfg)
    numerator, stats = loss_fn(logp, None, mb)
    loss = numerator / denominator_fn(mb)
    loss.backward()
    assert abs(loss.item() - case["loss"]) < TOL
    verl_grad = torch.cat(
        [torch.tensor(row[:n], dtype=torch.float64) for row, n in zip(case["grad"], inp["lengths"])]
    )
    beyond = [g for row, n in zip(case["grad"], inp["lengths"]) for g in row[n:]]
    assert all(g == 0.0 for g in beyond)  # verl: no gradient on padding either
    assert torch.allclose(logp.grad, verl_grad, atol=TOL, rtol=0)
    if case["objective"] != "sapo":  # verl reports 0 for SAPO
        frac = float(stats["clip_count"] / stats["token_count"])
        assert abs(frac - case["clipfrac"]) < TOL

"""KL estimators and ``algorithm.kl_clamp``: hand values, config validation, and the path from
the config through ``make_policy_loss`` (which ``trainer.rl_step`` calls with ``cfg.algorithm``)
to the loss."""

import dataclasses
import math

import pytest
import torch

from areal_mega.algo import compute_advantages, kl_estimate, make_policy_loss
from areal_mega.config import AlgorithmConfig, ConfigError, load_config

KL_ON = ["ref.enabled=true", "algorithm.kl_coef=0.5"]


def k3(d: float) -> float:
    """k3 of the log ratio d = log π − log π_ref, by hand."""
    return math.exp(-d) - 1.0 + d


# ----------------------------------------------------------------------------- estimators


def test_kl_estimators_hand_values_and_grad():
    ref = torch.zeros(4)
    logp = torch.tensor([0.5, -0.5, 0.0, 3.0], requires_grad=True)
    mask = torch.tensor([1, 1, 1, 0])
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k1", mask), torch.tensor([0.5, -0.5, 0.0, 0.0])
    )
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k2", mask), torch.tensor([0.125, 0.125, 0.0, 0.0])
    )
    k3_t = kl_estimate(logp, ref, "k3", mask)
    torch.testing.assert_close(k3_t, torch.tensor([k3(0.5), k3(-0.5), 0.0, 0.0]))
    k3_t.sum().backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([1 - math.exp(-0.5), 1 - math.exp(0.5), 0.0, 0.0])
    )
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_k1_k3_unbiased_under_the_policy():
    """E_{y~π}[k] = KL(π‖π_ref) exactly for k1 and k3 (enumerate a categorical)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = float((p * (p / q).log()).sum())
    for est in ("k1", "k3"):
        assert float((p * kl_estimate(p.log(), q.log(), est)).sum()) == pytest.approx(kl)
    assert float((p * kl_estimate(p.log(), q.log(), "k2")).sum()) > 0


def test_k3_clamp_exactly_at_the_bound_and_no_gradient_there():
    # d = -3: k3 = e^3 - 4 = 16.09 > 10 -> exactly 10; d = -2: 4.39 and d = 0.5: 0.11 unchanged
    ref = torch.zeros(4)
    logp = torch.tensor([-3.0, -2.0, 0.5, -3.0], requires_grad=True)
    mask = torch.tensor([1, 1, 1, 0])
    out = kl_estimate(logp, ref, "k3", mask, clamp=10.0)
    assert float(out[0].detach()) == 10.0
    torch.testing.assert_close(out, torch.tensor([10.0, k3(-2.0), k3(0.5), 0.0]))
    out.sum().backward()  # the clamped token gets no KL gradient, the others 1 - e^-d
    torch.testing.assert_close(
        logp.grad, torch.tensor([0.0, 1 - math.exp(2.0), 1 - math.exp(-0.5), 0.0])
    )
    # a bound equal to a token's value leaves it unchanged; unclamped it is the raw value
    bound = float(kl_estimate(torch.tensor([-2.0]), torch.zeros(1), "k3"))
    assert float(kl_estimate(torch.tensor([-2.0]), torch.zeros(1), "k3", clamp=bound)) == bound
    assert float(kl_estimate(torch.tensor([-3.0]), torch.zeros(1), "k3")) == pytest.approx(k3(-3.0))


def test_clamp_leaves_k1_k2_alone_as_verl():
    logp, ref = torch.tensor([-3.0, 4.0]), torch.zeros(2)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1", clamp=1.0), torch.tensor([-3.0, 4.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2", clamp=1.0), torch.tensor([4.5, 8.0]))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_kl_estimate_rejects_a_bad_clamp(bad):
    with pytest.raises(ValueError, match="clamp"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k3", clamp=bad)


# ----------------------------------------------------------------------------- config


def test_kl_clamp_config_default_and_null():
    assert AlgorithmConfig().kl_clamp == 10.0
    assert load_config(None, []).algorithm.kl_clamp == 10.0
    assert load_config(None, ["algorithm.kl_clamp=null"]).algorithm.kl_clamp is None
    assert load_config(None, ["algorithm.kl_clamp=2"]).algorithm.kl_clamp == 2.0


@pytest.mark.parametrize(
    "value, words",
    [
        ("-1", ["> 0"]),
        ("0", ["> 0"]),
        ("nan", ["nan"]),
        (".nan", ["nan"]),
        ("inf", ["finite"]),
        (".inf", ["finite"]),
        ("-.inf", ["> 0"]),
        ("abc", ["float"]),
    ],
)
def test_kl_clamp_config_rejects_bad_values(value, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"algorithm.kl_clamp={value}"])
    assert "algorithm.kl_clamp" in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# ----------------------------------------------------------------------------- wiring


def kl_mb(d: list[float]) -> dict:
    """One micro-batch of one sequence, on-policy (π_θ = π_prox = π_behav), advantages 0, and a
    reference with log ratio ``d`` on each loss token; the last token is not trained."""
    n = len(d) + 1
    logp = torch.full((n,), -1.0)
    return {
        "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
        "loss_mask": torch.tensor([1] * len(d) + [0]),
        "advantages": torch.zeros(n),
        "logprobs": logp.clone(),
        "versions": torch.zeros(n, dtype=torch.long),
        "ref_logprobs": logp - torch.tensor(d + [0.0]),
    }


def test_kl_clamp_reaches_the_loss_via_make_policy_loss():
    """The loss the trainer builds from the loaded config clamps k3 at ``algorithm.kl_clamp``."""
    d = [-3.0, -2.0, 0.5]
    for clamp, expect in [
        ("2.0", [2.0, 2.0, k3(0.5)]),
        ("null", [k3(x) for x in d]),
        (None, [10.0, k3(-2.0), k3(0.5)]),
    ]:  # None: the default
        extra = [] if clamp is None else [f"algorithm.kl_clamp={clamp}"]
        cfg = load_config(None, KL_ON + extra)
        loss_fn, denominator_fn = make_policy_loss(
            cfg.algorithm, max_response_len=cfg.rollout.max_new_tokens
        )
        mb = kl_mb(d)
        mb["prox_logprobs"] = mb["logprobs"]
        num, stats = loss_fn(mb["logprobs"], None, mb)
        assert float(stats["kl_ref_sum"]) == pytest.approx(sum(expect), rel=1e-6)
        assert float(num) / denominator_fn(mb) == pytest.approx(0.5 * sum(expect) / 3, rel=1e-6)


def test_kl_clamp_applies_to_the_kl_in_the_reward():
    cfg = dataclasses.replace(
        AlgorithmConfig(), kl_coef=1.0, kl_in_reward=True, kl_clamp=1.0, group_norm=False
    )
    b = kl_mb([-3.0, 0.5])
    b.update(rewards=torch.tensor([0.0]), group_index=torch.tensor([0]))
    _, stats = compute_advantages(b, cfg)
    assert stats["kl_reward_mean"] == pytest.approx((1.0 + k3(0.5)) / 2, rel=1e-6)

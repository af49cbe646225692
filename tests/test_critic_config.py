"""Critic configuration rules, the value loss and the GAE planning hook (no engine)."""

import json

import numpy as np
import pytest
import torch

from areal_mega.algo.value_loss import explained_variance, finalize_value_stats, value_loss
from areal_mega.config import ConfigError, check_against_model, load_config


@pytest.mark.parametrize(
    "override, words",
    [
        (["algorithm.adv_estimator=gae"], ["algorithm.adv_estimator", "critic.enabled=true"]),
        (["critic.enabled=true"], ["critic.enabled=true", "adv_estimator='gae'"]),
        (
            [
                "algorithm.adv_estimator=gae",
                "critic.enabled=true",
                "critic.lr=1e-6",
                "critic.min_lr=1e-3",
            ],
            ["critic.min_lr"],
        ),
        (
            [
                "algorithm.adv_estimator=gae",
                "critic.enabled=true",
                "critic.warmup_steps=5",
                "total_steps=5",
            ],
            ["critic.warmup_steps"],
        ),
        (
            ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1", "ref.enabled=true"],
            ["algorithm.kl_in_reward", "adv_estimator=gae"],
        ),
    ],
)
def test_bad_critic_config_gets_one_clear_error(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_kl_in_reward_is_allowed_with_a_critic():
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=gae",
            "critic.enabled=true",
            "algorithm.kl_in_reward=true",
            "algorithm.kl_coef=0.1",
            "ref.enabled=true",
        ],
    )
    assert cfg.critic.enabled and cfg.algorithm.kl_in_reward


def test_critic_path_that_is_not_a_model(tmp_path):
    gae = ["algorithm.adv_estimator=gae", "critic.enabled=true"]
    with pytest.raises(ConfigError, match=r"critic\.path=.*not an HF model directory"):
        check_against_model(load_config(None, gae + [f"critic.path={tmp_path}"]))
    (tmp_path / "config.json").write_text(json.dumps({"foo": 1}))
    with pytest.raises(ConfigError, match=r"critic\.path=.*no model_type"):
        check_against_model(load_config(None, gae + [f"critic.path={tmp_path}"]))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    check_against_model(load_config(None, gae + [f"critic.path={tmp_path}"]))


def test_value_loss_clips_and_counts():
    v = torch.tensor([1.0, 0.0, 2.0, 5.0])
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ret = torch.tensor([1.0, 1.0, 0.0, 9.0])
    mask = torch.tensor([1, 1, 1, 0])
    total, st = value_loss(v, old, ret, mask, clip=0.5)
    # token 0: max(0, (0.5-1)^2=0.25); token 1: max(1, 1); token 2: max(4, (0.5)^2) = 4
    assert float(total) == pytest.approx(0.5 * (0.25 + 1.0 + 4.0))
    assert float(st["value_clip_count"]) == 1.0 and float(st["value_token_count"]) == 3.0
    unclipped, _ = value_loss(v, old, ret, mask, clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (0.0 + 1.0 + 4.0))
    out = finalize_value_stats({k: float(x) for k, x in st.items()})
    assert out["clip_frac"] == pytest.approx(1 / 3) and out["return_mean"] == pytest.approx(2 / 3)


def test_explained_variance_edges():
    r = np.array([0.0, 1.0, 2.0, 3.0])
    perfect = explained_variance(4, r.sum(), (r * r).sum(), 0.0, 0.0)
    assert perfect == 1.0
    res = r - 1.5  # V = mean: explains nothing
    assert explained_variance(
        4, r.sum(), (r * r).sum(), res.sum(), (res * res).sum()
    ) == pytest.approx(0.0)
    assert explained_variance(1, 1.0, 1.0, 0.0, 0.0) == 0.0
    assert explained_variance(3, 3.0, 3.0, 0.0, 0.0) == 0.0  # constant returns


def test_gae_planning_leaves_advantages_to_the_step():
    from areal_mega.dataplane.trajectory import Trajectory
    from areal_mega.train.batches import group_advantages

    cfg = load_config(None, ["algorithm.adv_estimator=gae", "critic.enabled=true"])
    trajs = [
        Trajectory.from_tokens(
            [1, 2], [3, 4, 5], [-0.1] * 3, [0] * 3, reward=1.0, sample_id=f"s{i}", group_id="g"
        )
        for i in range(2)
    ]
    kept, advs, _ = group_advantages(trajs, cfg.algorithm, max_response_len=8)
    assert len(kept) == 2 and all(a.shape == (5,) and not a.any() for a in advs)

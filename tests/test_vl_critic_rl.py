"""RL with images and a critic end to end on the CPU: 3 PPO steps (GAE, ``critic.enabled``) of
a tiny Qwen2.5-VL on the synthetic counting task through ``launch.local`` (tests/test_vl_rl.py's
run: CPU rollout server sent each prompt's images, trainer packing them with the samples). The
critic (the VL model with a value head) is built, loaded from the start checkpoint and trained
every step, on policy, and checkpointed with the actor."""

import pytest

from tests.test_vl_rl import _check_on_policy, _vl_run

pytestmark = pytest.mark.slow


def test_ppo_with_a_vl_critic_through_the_cpu_server(tmp_path):
    _, _, run, rows = _vl_run(
        tmp_path,
        3,
        "algorithm.adv_estimator=gae",
        "critic.enabled=true",
        "critic.lr=1e-3",
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_on_policy(rows)
    for r in rows:
        assert r["critic/grad_norm"] > 0 and r["critic/value_loss"] > 0, r["step"]
        assert "critic/explained_variance" in r and "adv/advantage_mean" in r
    # the values move with the critic's training
    assert len({round(r["critic/old_value_mean"], 6) for r in rows}) == 3
    # saved with the actor's checkpoint at the end
    assert sorted(p.name for p in run.glob("checkpoints/critic/iter_*")) == ["iter_0000003"]

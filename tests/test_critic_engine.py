"""The critic (PPO value model): layouts, GAE in the RL step, resume, initial weights.

Two gloo launches of tests/helpers/critic_worker.py (CPU, fp32): ``layouts`` (2 ranks) checks
that the critic's values and value-loss gradients at DP2, TP2, TP2+SP, PP2 and PP2 with VPP 2 on a
4-layer model (variable lengths) equal a single-rank reference within 1e-5, as
tests/test_engine_multirank.py does for the actor;
``single`` (1 rank) checks the GAE of a real RL step against the torch reference, an exact
resume from a critic checkpoint, and loading an LM checkpoint / an HF ``score`` head.
"""

import os

import pytest

from areal_mega.common.net import free_port
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd

WORKER = "critic_worker"  # tests.helpers.critic_worker
TOL = 1e-5


def _launch(scenario, tmp_path, world, timeout=300):
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = run_ranks(
        [worker_cmd(WORKER, scenario, r, world, port, tmp_path) for r in range(world)],
        timeout=timeout,
        env=env,
    )
    return rank_results([tmp_path / f"{scenario}.{r}.json" for r in range(world)], ranks)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return _launch("layouts", tmp_path_factory.mktemp("critic_layouts"), world=2)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _launch("single", tmp_path_factory.mktemp("critic_single"), world=1)[0]


@pytest.mark.parametrize("layout", ["dp2", "tp2", "tp2sp", "pp2"])
def test_critic_layouts_match_single_rank(layouts, layout):
    for r in layouts:
        assert r["ref.grad_norm"] > 1e-3 and r["ref.head_grad_norm"] > 1e-3, r
        for what in ("values", "grads", "loss"):
            assert r[f"{layout}.{what}"] < TOL, (layout, what, r)


def test_critic_trains_under_interleaved_pipeline(layouts):
    """PP2 × VPP2 (4 layers, variable lengths): the value head on the last virtual chunk;
    values, value-loss gradients and loss equal the reference."""
    for r in layouts:
        for what in ("values", "grads", "loss"):
            assert r[f"pp2vpp2.{what}"] < TOL, (what, r)


def test_gae_of_the_rl_step_equals_the_torch_reference(single):
    """Several micro-batches, a truncated sample bootstrapped with its last value, and a
    multi-turn loss mask with a gap: the step's advantages and returns are the reference's."""
    assert single["gae.n_micro_batches"] > 1
    assert single["gae.has_truncated"] == 1.0 and single["gae.has_multiturn"] == 1.0
    assert single["gae.max_diff"] < 1e-5
    assert {"adv/advantage_mean", "critic/old_value_mean", "critic/gae_return_mean"} <= set(
        single["gae.stats_keys"]
    )


def test_kl_in_reward_with_the_critic(single):
    """k1 KL of 0.2 per loss token: the reward penalty lowers the returns."""
    assert abs(single["kl.reward_mean"] - 0.2) < 1e-5
    assert single["kl.return_shift"] > 0.05


def test_resumed_critic_takes_the_same_next_step(single):
    assert single["resume.loss_diff"] == 0.0
    assert single["resume.values_diff"] == 0.0
    assert single["resume.lr_equal"] == 1.0 and single["resume.step_count"] == 3


def test_lm_checkpoint_loads_the_trunk_and_a_score_head_the_head(single):
    assert single["lm.trunk_diff"] == 0.0 and single["lm.head_unchanged"] == 1.0
    assert single["score.loaded"] == 1.0 and single["score.head_diff"] == 0.0
    assert "score.weight has shape (2, 64)" in single["score.bad_shape_error"]


def test_critic_learns_a_prefix_dependent_value(single):
    assert single["fit.ev_first"] < 0.2 and single["fit.ev_last"] > 0.5, single

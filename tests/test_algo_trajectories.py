"""Filtering and advantages on trajectories before packing (areal_mega.algo.trajectories):
the same numbers as the packed-batch functions on a batch packed from the same trajectories,
and hand-computed GRPO values."""

import dataclasses

import numpy as np
import pytest
import torch

from areal_mega.algo import (
    compute_advantages,
    dynamic_filter,
    filter_trajectories,
    sequence_fields,
    trajectory_advantages,
    with_algo_fields,
)
from areal_mega.config import AlgorithmConfig
from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train import batches

# group ids interleaved (first appearance b, a, c); group "c" is uniform
SPEC = [
    ("b", 1.0, 3, "stop"),
    ("a", 0.0, 4, "length"),
    ("b", 0.0, 2, "stop"),
    ("a", 1.0, 5, "stop"),
    ("c", 1.0, 3, "stop"),
    ("a", 0.5, 2, "stop"),
    ("c", 1.0, 4, "length"),
]


def trajectories(seed=0, per_token_reward=False):
    g = np.random.default_rng(seed)
    out = []
    for i, (gid, r, n_gen, fin) in enumerate(SPEC):
        n = 3 + n_gen
        lp = -g.random(n_gen).astype(np.float32) - 0.05
        extras = {
            "ref_logprobs": -g.random(n).astype(np.float32),
            "prox_logprobs": -g.random(n).astype(np.float32),
            "values": g.standard_normal(n).astype(np.float32),
        }
        reward = r
        if per_token_reward and i == 3:
            reward = np.zeros(n, np.float32)
            reward[-2:] = [0.25, 0.75]
        out.append(
            Trajectory.from_tokens(
                np.arange(3) + i,
                np.arange(n_gen) + 100,
                lp,
                np.zeros(n_gen, np.int32),
                reward=reward,
                sample_id=f"s{i}",
                group_id=gid,
                finish_reason=fin,
                token_extras=extras,
            )
        )
    return out


def packed_reference(trajs, cfg, max_len):
    """The packed-batch path: pack, derive fields, filter, compute, slice back per sequence."""
    full = with_algo_fields(pack_sequences(trajs))
    kept, fstats = dynamic_filter(full, cfg.dynamic_filter)
    out, astats = compute_advantages(kept, cfg, max_response_len=max_len)
    cu = kept["cu_seqlens"].tolist()
    advs = [out["advantages"][cu[b] : cu[b + 1]].numpy() for b in range(len(cu) - 1)]
    return kept["sample_ids"], advs, fstats, astats


CONFIGS = {
    "grpo": {},
    "grpo_shaped": dict(
        zero_reward_without_eos=True,
        overlong_buffer=2,
        group_std=False,
        batch_norm=True,
        reward_scale=2.0,
        reward_bias=-0.5,
    ),
    "rloo_filter": dict(leave_one_out=True, dynamic_filter=True),
    "grpo_kl_in_reward": dict(kl_in_reward=True, kl_coef=0.3, kl_estimator="k3"),
    "reinforce": dict(adv_estimator="reinforce", gamma=0.9, batch_norm=True),
    "gae": dict(adv_estimator="gae", gamma=0.95, lam=0.9, dynamic_filter=True),
    # verl's estimators (areal_mega.algo.estimators)
    "rloo": dict(adv_estimator="rloo"),
    "opo": dict(adv_estimator="opo", dynamic_filter=True),
    "grpo_passk": dict(adv_estimator="grpo_passk", group_std=False),
    "reinforce_plus_plus": dict(adv_estimator="reinforce_plus_plus", gamma=0.9),
    "reinforce_plus_plus_baseline": dict(
        adv_estimator="reinforce_plus_plus_baseline", zero_reward_without_eos=True
    ),
}


@pytest.mark.parametrize("per_token_reward", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_trajectory_path_equals_packed_path(name, per_token_reward):
    cfg = dataclasses.replace(AlgorithmConfig(), **CONFIGS[name])
    trajs = trajectories(per_token_reward=per_token_reward)
    ref_ids, ref_advs, ref_fstats, ref_astats = packed_reference(trajs, cfg, 6)
    kept, fstats = filter_trajectories(trajs, cfg.dynamic_filter)
    assert [t.sample_id for t in kept] == ref_ids and fstats == ref_fstats
    advs, astats = trajectory_advantages(kept, cfg, max_response_len=6)
    assert astats == ref_astats
    assert len(advs) == len(ref_advs)
    for t, a, r in zip(kept, advs, ref_advs):
        assert a.dtype == np.float32 and a.shape == (len(t.input_ids),)
        assert np.array_equal(a, r), t.sample_id
    if name == "grpo_kl_in_reward":
        assert astats["kl_reward_mean"] > 0  # the extras reached the estimator
    if name == "rloo_filter":
        assert ref_ids == ["s0", "s1", "s2", "s3", "s5"]  # uniform group c dropped
    # batches.group_advantages is this path, except GAE: it needs the critic's values, so the
    # RL step computes it (train/critic_step.py) and planning carries zeros until then
    k2, a2, st = batches.group_advantages(trajs, cfg, max_response_len=6)
    assert [t.sample_id for t in k2] == ref_ids
    if name == "gae":
        assert all(not x.any() and x.shape == (len(t.input_ids),) for x, t in zip(a2, k2))
        assert not any(k.startswith("adv/") for k in st)
        return
    assert all(np.array_equal(x, y) for x, y in zip(a2, advs))
    assert st["adv/advantage_mean"] == ref_astats["advantage_mean"]
    if name in ("rloo", "opo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        assert any(x.any() for x in advs)  # the estimator produced signal


def test_sequence_fields_and_grpo_values():
    trajs = trajectories()
    seq = sequence_fields(trajs)
    assert seq["group_index"].tolist() == [0, 1, 0, 1, 2, 1, 2]  # first appearance b, a, c
    assert seq["seq_no_eos"].tolist() == [False, True, False, False, False, False, True]
    assert seq["response_lens"].tolist() == [3, 4, 2, 5, 3, 2, 4]
    assert seq["rewards"].dtype == torch.float32
    cfg = dataclasses.replace(AlgorithmConfig(), group_std=False)
    advs, _ = trajectory_advantages(trajs, cfg)
    # group b: [1, 0] -> ±0.5; group a: [0, 1, .5] -> [-.5, .5, 0]; group c uniform -> 0
    expect = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]
    for _t, a, e in zip(trajs, advs, expect):
        assert a[:3].tolist() == [0.0] * 3  # prompt: no advantage
        assert a[3:].tolist() == pytest.approx([e] * (len(a) - 3), abs=1e-6)


def test_missing_extra_is_named():
    trajs = trajectories()
    del trajs[2].token_extras["ref_logprobs"]
    cfg = dataclasses.replace(AlgorithmConfig(), kl_in_reward=True, kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs.*s2"):
        trajectory_advantages(trajs, cfg)

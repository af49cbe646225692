"""A mean over zero tokens is left out of the metrics row, never written as NaN or 0: the policy
loss's reducer (``mismatch`` on a step with no token of the trainer's version; every per-token
mean with no loss token), the critic's value statistics, the advantage statistics, the batch
statistics; and every consumer of those keys (metrics file, plot, progress bar, trackers, the
demo's summary) works on rows without them."""

import dataclasses
import json
import math

import pytest
import torch

from areal_mega.algo import compute_advantages, finalize_stats, policy_loss
from areal_mega.algo.value_loss import finalize_value_stats
from areal_mega.config import AlgorithmConfig
from areal_mega.demo import mismatch_text, summarize
from areal_mega.tracking.base import finite_scalars
from areal_mega.tracking.metrics import MetricsLogger, ProgressBar, plot_metrics, read_metrics
from areal_mega.train.batches import merge_train_stats


def _mb(versions, policy_version):
    return {
        "cu_seqlens": torch.tensor([0, 2, 4], dtype=torch.int32),
        "loss_mask": torch.tensor([1, 1, 0, 1], dtype=torch.uint8),
        "prox_logprobs": torch.tensor([-1.1, -2.0, 0.0, -1.0]),
        "logprobs": torch.tensor([-1.2, -3.0, 0.0, -1.0]),
        "advantages": torch.tensor([1.0, 1.0, -1.0, -1.0]),
        "versions": torch.tensor(versions, dtype=torch.int32),
        "policy_version": policy_version,
    }


def _finite(row: dict) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


def test_mismatch_without_tokens_of_the_trainer_version_is_absent():
    cfg = AlgorithmConfig()
    lp = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    _, stale = policy_loss(lp, None, _mb([2, 2, -1, 2], policy_version=3), cfg)
    _, fresh = policy_loss(lp, None, _mb([3, 3, -1, 3], policy_version=3), cfg)
    out = finalize_stats(stale)
    assert "mismatch" not in out and out["mismatch_tokens"] == 0
    assert "ppo_kl" in out and "behav_diff" in out and _finite(out)
    # the engine's per-minibatch stats as the trainer merges them: defined when one has tokens
    engine = {"loss": 0.5, "grad_norm": 1.0, "lr": 1e-3, "n_tokens": 3.0}
    row = merge_train_stats([{**engine, **{k: float(v) for k, v in stale.items()}}], finalize_stats)
    assert "mismatch" not in row and _finite(row)
    row = merge_train_stats(
        [{**engine, **{k: float(v) for k, v in s.items()}} for s in (stale, fresh)], finalize_stats
    )
    assert row["mismatch_tokens"] == 3 and row["mismatch"] == finalize_stats(fresh)["mismatch"]


def test_no_loss_token_leaves_every_per_token_mean_out():
    out = finalize_stats(
        {
            "token_count": 0.0,
            "seq_count": 0.0,
            "clip_count": 0.0,
            "ppo_kl_sum": 0.0,
            "imp_weight_sum": 0.0,
            "imp_weight_sq_sum": 0.0,
            "moe_aux_loss_sum": 3.0,
            "moe_aux_loss_tokens": 2.0,
        }
    )
    assert out == {
        "token_count": 0.0,
        "seq_count": 0.0,
        "moe_aux_loss": 1.5,
        "moe_aux_loss_tokens": 2.0,
    }


def test_value_and_advantage_stats_leave_undefined_values_out():
    base = {
        "value_token_count": 3.0,
        "value_loss_sum": 0.3,
        "value_clip_count": 1.0,
        "value_sum": 1.5,
        "return_sum": 3.0,
        "residual_sum": 0.0,
        "residual_sq_sum": 0.1,
    }
    constant = finalize_value_stats({**base, "return_sq_sum": 3.0})  # returns all 1
    assert "explained_variance" not in constant and constant["value_loss"] == pytest.approx(0.1)
    varied = finalize_value_stats({**base, "return_sq_sum": 5.0})
    assert math.isfinite(varied["explained_variance"])
    assert finalize_value_stats({"value_token_count": 0.0}) == {}
    cfg = dataclasses.replace(AlgorithmConfig(), kl_in_reward=True, kl_coef=0.1)
    batch = {
        "loss_mask": torch.zeros(4, dtype=torch.bool),
        "cu_seqlens": torch.tensor([0, 2, 4], dtype=torch.int32),
        "rewards": torch.tensor([1.0, 0.0]),
        "group_index": torch.tensor([0, 0]),
        "logprobs": torch.zeros(4),
        "ref_logprobs": torch.zeros(4),
    }
    _, stats = compute_advantages(batch, cfg)
    assert not {"advantage_mean", "advantage_std", "kl_reward_mean"} & set(stats)
    assert stats["reward_mean"] == 0.5 and _finite(stats)


def test_consumers_work_on_rows_without_the_keys(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    rows = [
        {"version": 0, "reward/mean": 0.2, "loss": 0.1, "ppo_kl": 0.0, "time/step": 1.0},
        {
            "version": 1,
            "reward/mean": 0.3,
            "loss": 0.1,
            "time/step": 1.0,
            "mismatch": 1e-6,
            "mismatch_tokens": 5.0,
        },
        {"version": 2, "loss": 0.1, "time/step": 1.0, "mismatch_tokens": 0.0},
    ]
    for step, row in enumerate(rows, start=1):
        log.log(step, row)
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "mismatch" in text
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert "mismatch" not in recs[2] and "reward/mean" not in recs[2]
    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "curve.png").exists()
    assert ProgressBar.postfix(recs[2]) == {"v": "2", "loss": "0.1000"}
    assert finite_scalars(recs[2]) == {
        "version": 2,
        "loss": 0.1,
        "time/step": 1.0,
        "mismatch_tokens": 0.0,
    }
    s = summarize(tmp_path / "metrics.jsonl")
    assert s["mismatch_steps"] == 1 and s["mismatch_mean"] == s["mismatch_max"] == 1e-6
    assert s["reward_first10"] == 0.25 and s["steps"] == 3
    assert "1.00e-06" in mismatch_text(s)
    recs_none = [r for r in rows if "mismatch" not in r]
    with open(tmp_path / "none.jsonl", "w") as f:
        for step, r in enumerate(recs_none, start=1):
            f.write(json.dumps({"step": step, **r}) + "\n")
    s = summarize(tmp_path / "none.jsonl")
    assert "mismatch_mean" not in s and "none measured" in mismatch_text(s)

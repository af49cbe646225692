"""No non-finite update is ever applied, and no checkpoint holds non-finite weights.

One launch of tests/helpers/nonfinite_worker.py as 2 gloo processes (DP2, CPU, fp32, the production
policy loss and megatron-core's distributed optimizer): NaN advantages on rank 1 alone make
both ranks skip the optimizer step together; the skip guard names the advantages on both and
stops the run after ``max_consecutive`` skips in a row; saving and loading NaN weights is
refused. Pure checks of the guard's helpers run in-process.
"""

import math
import os

import numpy as np
import pytest
import torch

from areal_mega.common.net import free_port
from areal_mega.engine.finite import all_finite, nonfinite_flags
from areal_mega.train.batches import merge_train_stats
from areal_mega.train.nonfinite import SkipGuard, likely_source, nonfinite_fields
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    port = str(free_port())
    ranks = run_ranks(
        [worker_cmd("nonfinite_worker", "dp2", r, 2, port, out) for r in range(2)],
        timeout=400,
        env=env,
    )
    return rank_results([out / f"dp2.{r}.json" for r in range(2)], ranks)


def test_nan_on_one_rank_skips_the_step_on_every_rank(dp2):
    for r in dp2:
        assert r["skip.skipped"] == 1.0 and r["skip.nonfinite_loss"] == 1.0, r
        assert r["skip.moved"] == 0.0 and r["skip.step_count_moved"] == 0, r
        assert (
            "loss" not in r["skip.merged_keys"] and "skipped_minibatches" in r["skip.merged_keys"]
        )
        assert r["skip.metrics"] == {
            "train/skipped": 1.0,
            "train/skipped_steps": 1.0,
            "train/skip_reason/advantages": 1.0,
        }


def test_a_clean_step_after_a_skip_applies(dp2):
    for r in dp2:
        assert r["clean.skipped"] == 0.0 and r["clean.moved"] > 0
        assert r["clean.step_count_moved"] == 1
        assert r["clean.metrics"] == {"train/skipped": 0.0, "train/skipped_steps": 1.0}


def test_consecutive_skips_stop_the_run_naming_the_source(dp2):
    for r in dp2:
        msg = r["stop.message"]
        assert msg and "2 training steps in a row (steps 3..4)" in msg, msg
        assert "likely source: the advantages" in msg and "advantages" in msg
        assert r["weights_finite"]


def test_checkpoints_never_hold_non_finite_weights(dp2):
    for r in dp2:
        assert r["save.refused"] and "refusing to save iter_0000002" in r["save.refused"]
        assert "(rank 1)" in r["save.refused"]
        assert not r["save.iter2_exists"]
        assert r["load.refused"] and "NaN/inf values after loading" in r["load.refused"]
        assert r["load.good_iteration"] == 1


def test_nonfinite_fields_and_likely_source():
    mbs = [
        {
            "advantages": torch.zeros(4),
            "teacher_logprobs": torch.tensor([0.0, math.nan]),
            "rewards": np.array([1.0], np.float32),
            "input_ids": torch.zeros(4, dtype=torch.long),
        }
    ]
    assert nonfinite_fields(mbs) == ["teacher_logprobs"]
    assert likely_source(["advantages", "teacher_logprobs"]) == "teacher"
    assert likely_source(["rewards", "advantages"]) == "rewards"
    assert likely_source([], lr=math.inf) == "learning rate"
    assert likely_source([], lr=1e-3, routing_replay=True) == "routes"
    assert likely_source([], lr=1e-3) == "learning rate"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_agrees_with_isfinite(dtype):
    """The one-pass check of the gradients equals ``torch.isfinite(t).all()``: a NaN or inf
    anywhere (first, last, a vectorised block's tail, every size around the vector widths),
    on contiguous and strided tensors, empty tensors finite."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 15, 16, 17, 31, 33, 64, 65, 1000, 4099):
        base = (torch.randn(n, generator=g) * 100).to(dtype)
        assert all_finite(base) and bool(torch.isfinite(base).all())
        for bad in (math.nan, math.inf, -math.inf):
            for pos in sorted({0, n // 2, n - 1, max(n - 17, 0)}):
                t = base.clone()
                t[pos] = bad
                assert not all_finite(t), (n, bad, pos)
                assert not all_finite(torch.stack([base, t], 1)[:, 1])  # strided view
    big = torch.full((2048, 64), torch.finfo(dtype).max, dtype=dtype)  # finite extremes
    assert all_finite(big) and all_finite(-big)
    assert all_finite(torch.empty(0, 3, dtype=dtype))
    assert nonfinite_flags(None, [base, big]) == (False, False)
    assert nonfinite_flags(math.nan, [base, t]) == (True, True)


def test_merge_train_stats_leaves_skipped_minibatches_out():
    fin = lambda d: d  # noqa: E731 - the loss sums pass through
    ok = {"loss": 1.0, "grad_norm": 2.0, "lr": 0.1, "pg": 3.0, "skipped": 0.0}
    bad = {
        "loss": math.nan,
        "grad_norm": math.nan,
        "lr": 0.1,
        "pg": math.nan,
        "skipped": 1.0,
        "nonfinite_loss": 1.0,
        "nonfinite_grad": 1.0,
    }
    out = merge_train_stats([ok, bad], fin)
    assert out == {
        "skipped_minibatches": 1.0,
        "nonfinite_loss": 1.0,
        "nonfinite_grad": 1.0,
        "lr": 0.1,
        "pg": 3.0,
        "loss": 1.0,
        "grad_norm": 2.0,
    }
    assert merge_train_stats([bad], fin) == {
        "skipped_minibatches": 1.0,
        "nonfinite_loss": 1.0,
        "nonfinite_grad": 1.0,
        "lr": 0.1,
    }


def test_skip_guard_counts_and_resets():
    g = SkipGuard(max_consecutive=2)
    skipped = {"skipped_minibatches": 1.0, "nonfinite_loss": 1.0, "lr": 1e-3}
    g.record(1, skipped, [])
    g.record(2, {"lr": 1e-3}, [])  # an applied step ends the run of skips
    g.check()
    assert g.record(3, skipped, [])["train/skipped_steps"] == 2.0
    g.check()
    g.record(4, skipped, [])
    with pytest.raises(RuntimeError, match="steps 3..4.*learning rate"):
        g.check()


def test_an_error_in_the_forward_names_the_micro_batchs_samples(dp2):
    """What the trainer records for the quarantine when it dies on a micro-batch."""
    for rank, r in enumerate(dp2):
        assert r["blame.sample_ids"] == [f"r{rank}-0", f"r{rank}-1"], r.get("blame.error")

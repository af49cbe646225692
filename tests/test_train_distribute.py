"""batches.distribute over a real 2-rank gloo mesh: each rank receives only its own DP share."""

import os

import pytest

from areal_mega.common.net import free_port
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd

WORKER = "distribute_worker"  # tests.helpers.distribute_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distribute")
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = run_ranks([worker_cmd(WORKER, r, 2, port, out) for r in range(2)], timeout=300, env=env)
    return rank_results([out / f"distribute.{r}.json" for r in range(2)], ranks)


def test_dp2_each_rank_receives_only_its_own_micro_batches(results):
    for rank, res in enumerate(results):
        r = res["dp2tp1"]
        assert r["dp_rank"] == rank
        assert r["type"] == "StepBatch" and r["fields"] == ["micro_batches", "stats"]
        assert r["sample_ids"] == [[f"d{rank}m0"], [f"d{rank}m1"]]
        assert r["n_tokens"] == [3 + 50 * rank, 4 + 50 * rank]
        assert r["stats"] == {"n_samples": 4}


def test_tp2_ranks_of_one_replica_receive_the_same_share(results):
    for res in results:
        r = res["dp1tp2"]
        assert r["dp_rank"] == 0
        assert r["sample_ids"] == [["d0m0"], ["d0m1"]]


def test_mesh_dp_rank_table_matches_the_process_groups(results):
    for res in results:
        for layout in ("dp2tp1", "dp1tp2"):
            r = res[layout]
            assert r["dp_ranks_by_global_rank"] == r["dp_ranks_gathered"]


def test_step_plan_needs_equal_micro_batch_counts_and_shares_by_dp_rank():
    from areal_mega.train.batches import StepBatch, StepPlan

    with pytest.raises(ValueError, match="same number of micro-batches"):
        StepPlan(micro_batches=[[{}], []], sample_ids=[], stats={})
    with pytest.raises(ValueError, match="same number of micro-batches"):
        StepPlan(micro_batches=[], sample_ids=[], stats={})
    a, b = {"x": 1}, {"x": 2}
    plan = StepPlan(micro_batches=[[a], [b]], sample_ids=["s0", "s1"], stats={"k": 1.0})
    assert plan.dp_size == 2
    share = plan.share(1)
    assert isinstance(share, StepBatch)
    assert share.micro_batches == [b] and share.stats == {"k": 1.0}

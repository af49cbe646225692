"""Context parallelism in the loss: a CP=2 rank's share of a packed micro-batch, fed to the
production losses through the engine's own loss path, gives the CP=1 loss, statistics and
gradients w.r.t. the logprobs (2 gloo processes, see tests/helpers/cp_loss_worker.py)."""

import os

import pytest

from areal_mega.common.net import free_port
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd

WORKER = "cp_loss_worker"  # tests.helpers.cp_loss_worker
#: fp32 sums of the same terms in another order (per shard, then across the 2 ranks)
TOL = 1e-5
NAMES = [
    "token_mean",
    "seq_mean",
    "seq_sum_norm",
    "gspo_seq_mean",
    "gspo_token_mean_geometric",
    "seq_weight_mask",
    "seq_weight_clamp",
    "ppo_dual_clip",
    "sft",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_loss")
    port, world = str(free_port()), 2
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = run_ranks(
        [worker_cmd(WORKER, r, world, port, out) for r in range(world)], timeout=300, env=env
    )
    return rank_results([out / f"cp_loss.{r}.json" for r in range(world)], ranks)


@pytest.mark.parametrize("name", NAMES)
def test_cp2_loss_matches_cp1(results, name):
    for r in results:
        got = r[name]
        assert got["stat_keys_equal"] == 1.0, got
        assert got["grad_lp_max"] > 1e-3, "vacuous: no gradient reaches the logprobs"
        bad = {
            k: v
            for k, v in got.items()
            if (k.startswith("stat.") or k.startswith("grad_"))
            and k != "grad_lp_max"
            and not v < TOL
        }
        assert not bad, (name, bad)
        if name.startswith("seq_weight") or name == "gspo_token_mean_geometric":
            # the sequence-level weight cap is active, so its cross-shard sums matter
            assert 0 < got["values"]["imp_weight_capped_count"] < got["values"]["token_count"]

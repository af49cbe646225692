"""End to end on CPU with MoE routing replay (``algorithm.routing_replay=r3``): ``launch.local``
starts the CPU rollout server with ``--enable-return-routed-experts`` on a tiny qwen3_moe; the
routes of every token travel server -> rollout worker -> data plane -> trainer, whose routers
replay them. Every step the free-routing pass compares the trainer's own routes with the
rollout's over every routed token (``moe/route_rows`` = (tokens - samples) x MoE layers: each
sample's tokens but its last, which no server forwards), weight updates reach the server's
fused expert tensors, and no sample is trained twice."""

import pytest

from areal_mega.data.synthetic import write_task_files
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.local_runs import _finish, _launch, _metrics, _trained

pytestmark = pytest.mark.slow
STEPS, LAYERS = 4, 2


def test_routes_flow_from_the_server_to_the_replaying_trainer(tmp_path):
    model = make_tiny_model(
        tmp_path / "model",
        arch="qwen3_moe",
        charset="digits",
        hidden_size=64,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        num_experts=8,
    )
    write_task_files(tmp_path / "data", task="reverse", n_train=256, n_test=16)
    run = tmp_path / "run"
    proc = _launch(
        run,
        model,
        tmp_path / "data",
        f"total_steps={STEPS}",
        "algorithm.routing_replay=r3",
        "algorithm.routing_replay_free_every=1",
        "logging.plot=false",
        "cluster.max_restarts=0",
    )
    rc, out = _finish(proc, timeout=400)
    assert rc == 0, out[-4000:]
    rows = [r for r in _metrics(run) if r["step"]]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["moe/route_rows"] == (r["n_tokens_total"] - r["n_samples"]) * LAYERS, r
        assert 0.5 <= r["moe/route_agreement"] <= 1.0
    # step 1 is on-policy with the server's own weights: routes and logprobs agree
    assert rows[0]["moe/route_agreement"] == 1.0 and rows[0]["mismatch"] < 1e-5
    trained = [s for rec in _trained(run) for s in rec["sample_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * 16

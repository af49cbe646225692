"""Rollout routing replay (R3), trainer side: routes packed with the tokens, megatron-core's
RouterReplay driven per micro-batch, the ``moe/*`` metrics, and the config key.

The model checks run tests/helpers/routing_replay_worker.py: a tiny HF Qwen3-MoE plays the
server (its own router gives the routes), the trainer replays them on one rank (``single``) and in
EP2, TP2 (sequence parallel) and PP2 (full recompute) gloo layouts (``layouts``)."""

import json
import os

import numpy as np
import pytest
import torch

from areal_mega.common.net import free_port
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd

WORKER = "routing_replay_worker"  # tests.helpers.routing_replay_worker
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


# ----------------------------------------------------------------------------- pure helpers
def test_fill_missing_routes_gives_distinct_valid_experts_only_where_a_route_is_missing():
    from areal_mega.engine.routing_replay import fill_missing_routes

    routes = torch.tensor(
        [[[3, 1], [0, 2]], [[-1, -1], [-1, -1]], [[2, 3], [1, -1]]], dtype=torch.int16
    )
    out = fill_missing_routes(routes, num_experts=4)
    assert out.dtype == torch.int64
    assert torch.equal(out[0], routes[0].long())  # given rows untouched
    for t in (1, 2):
        for layer in range(2):
            ids = out[t, layer].tolist()
            assert all(0 <= i < 4 for i in ids) and len(set(ids)) == 2
    assert torch.equal(out[2, 0], routes[2, 0].long())  # per layer: only -1 rows
    assert out[1, 0].tolist() == [2, 3]  # (t·k + j) mod E


def test_moe_layer_columns_skip_dense_layers():
    from areal_mega.engine.routing_replay import moe_layer_columns

    assert moe_layer_columns([1, 1, 1]) == {1: 0, 2: 1, 3: 2}
    assert moe_layer_columns([0, 1, 0, 1]) == {2: 0, 4: 1}
    assert moe_layer_columns([0, 0]) == {}


def test_route_agreement_compares_sets_and_skips_unrouted_rows():
    from areal_mega.engine.routing_replay import route_agreement_counts

    free = torch.tensor([[1, 2], [3, 0], [1, 3], [0, 1]])
    rollout = torch.tensor([[2, 1], [3, 1], [-1, -1], [0, 1]], dtype=torch.int16)
    assert route_agreement_counts(free, rollout) == (2, 3)


def test_sequence_parallel_slice_is_the_contiguous_shard():
    from areal_mega.engine.routing_replay import sequence_parallel_slice

    assert sequence_parallel_slice(12, 3, 1) == slice(4, 8)
    with pytest.raises(ValueError, match="not divisible by TP=4"):
        sequence_parallel_slice(10, 4, 0)


def test_free_routing_due_and_mismatch_sums():
    from areal_mega.train.routing import free_routing_due, mismatch_sums

    assert [s for s in range(1, 8) if free_routing_due(s, 3)] == [1, 4, 7]
    assert not any(free_routing_due(s, 0) for s in range(1, 5))
    mb = {
        "loss_mask": torch.tensor([0, 1, 1, 1]),
        "versions": torch.tensor([-1, 2, 3, 3]),
        "logprobs": torch.tensor([0.0, -1.0, -2.0, -3.0]),
        "policy_version": 3,
    }
    total, n = mismatch_sums([mb], [torch.tensor([5.0, -1.5, -2.5, -2.0])])
    assert (total, n) == (pytest.approx(1.5), 2.0)  # only version-3 loss tokens count


def test_packed_routes_are_checked_against_the_model():
    from areal_mega.engine.routing_replay import check_routes

    ok = torch.tensor([[[0, 7], [-1, -1]]] * 3)
    check_routes(ok, 3, n_layers=2, topk=2, num_experts=8)
    with pytest.raises(
        ValueError,
        match=r"'routed_experts'.*shape \(3, 2, 2\), expected "
        r"\(3, 4, 2\)",
    ):
        check_routes(ok, 3, n_layers=4, topk=2, num_experts=8)
    with pytest.raises(ValueError, match=r"expert ids in \[-1, 7\], expected \[-1, 4\)"):
        check_routes(ok, 3, n_layers=2, topk=2, num_experts=4)


def test_replay_target_checks_name_the_key():
    from areal_mega.engine.routing_replay import check_replay_target
    from areal_mega.models.builder import parse_hf_config

    dense = parse_hf_config(
        dict(
            model_type="qwen3",
            vocab_size=100,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            max_position_embeddings=64,
            rope_theta=1e4,
            rms_norm_eps=1e-6,
        )
    )
    with pytest.raises(ValueError, match="algorithm.routing_replay='r3' needs a mixture-of-"):
        check_replay_target(True, "actor", dense)
    check_replay_target(False, "actor", dense)


# ----------------------------------------------------------------------------- packing
def _traj(n, layers=3, topk=2, seed=0):
    from areal_mega.dataplane.trajectory import Trajectory

    g = np.random.default_rng(seed)
    routes = g.integers(0, 8, size=(n, layers, topk)).astype(np.int16)
    routes[-1] = -1
    p = n // 2
    return Trajectory.from_tokens(
        g.integers(1, 50, p),
        g.integers(1, 50, n - p),
        np.full(n - p, -0.5, np.float32),
        np.zeros(n - p, np.int32),
        sample_id=f"s{seed}",
        group_id="g",
        token_extras={"routed_experts": routes},
    )


def test_routes_pack_unshifted_with_padding_rows_of_minus_one():
    from areal_mega.algo.batch import PackedBatch
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_sample

    trajs = [_traj(5, seed=1), _traj(4, seed=2)]
    samples = [next_token_sample(t, np.zeros(t.length, np.float32)) for t in trajs]
    packed = pack_sequences(samples, pad_to_multiple=4)
    mb = PackedBatch.from_packed(packed)
    r = mb.routed_experts
    assert tuple(r.shape) == (12, 3, 2) and r.dtype == torch.int16
    # row t = token t as the model input: the trajectory's own rows, not shifted like labels
    assert np.array_equal(r[0:5].numpy(), trajs[0].token_extras["routed_experts"])
    assert np.array_equal(r[5:9].numpy(), trajs[1].token_extras["routed_experts"])
    assert (r[9:] == -1).all()  # trailing padding
    assert mb.labels[4] == -1 and mb.labels[3] == trajs[0].input_ids[4]
    from areal_mega.engine.loss_context import loss_view

    assert "routed_experts" not in loss_view(mb, torch.device("cpu"))


def test_routes_follow_the_context_parallel_split():
    from areal_mega.scheduler.packing import pack_sequences, zigzag_cp_shard, zigzag_index
    from areal_mega.train.batches import next_token_sample

    trajs = [_traj(7, seed=3), _traj(3, seed=4)]
    samples = [next_token_sample(t, np.zeros(t.length, np.float32)) for t in trajs]
    packed = pack_sequences(samples, pad_to_multiple=4, cp_size=2)
    total = packed["input_ids"].numel()
    for rank in range(2):
        share = zigzag_cp_shard(packed, rank, 2)
        idx = zigzag_index(packed["cu_seqlens_padded"].tolist(), total, 2, rank)
        assert torch.equal(share["routed_experts"], packed["routed_experts"][idx])
        assert torch.equal(share["input_ids"], packed["input_ids"][idx])
    # CP slot padding gets -1 rows like trailing padding: 7 tokens in a slot of 8
    assert (packed["routed_experts"][7] == -1).all()


def test_routes_of_inconsistent_shapes_are_refused_naming_the_field():
    from areal_mega.algo.batch import PackedBatch
    from areal_mega.scheduler.packing import PackingError, pack_sequences
    from areal_mega.train.batches import next_token_sample

    a, b = _traj(5, layers=3, seed=1), _traj(4, layers=2, seed=2)
    samples = [next_token_sample(t, np.zeros(t.length, np.float32)) for t in (a, b)]
    with pytest.raises(
        PackingError,
        match=r"sequence 1: field 'routed_experts' has shape "
        r"\(4, 2, 2\), expected \(4, 3, 2,\)",
    ):
        pack_sequences(samples)
    mb = PackedBatch.from_packed(pack_sequences(samples[:1]))
    with pytest.raises(ValueError, match="'routed_experts' has shape"):
        mb.__class__(
            **{
                **{k: getattr(mb, k) for k in mb.__dataclass_fields__},
                "routed_experts": mb.routed_experts[:2],
            }
        )


# ----------------------------------------------------------------------------- config
def test_config_key_default_choices_and_model_checks(tmp_path):
    from areal_mega.config import ConfigError, check_against_model, load_config

    assert load_config(None, []).algorithm.routing_replay == "off"
    with pytest.raises(ConfigError, match="algorithm.routing_replay"):
        load_config(None, ["algorithm.routing_replay=r2"])
    with pytest.raises(ConfigError, match="algorithm.routing_replay='r3'.*mode=rl"):
        load_config(None, ["algorithm.routing_replay=r3", "mode=sft"])
    for name, hf in (
        ("dense", {"model_type": "qwen3"}),
        ("moe", {"model_type": "qwen3_moe", "num_local_experts": 8}),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf))
    cfg = load_config(None, [f"model.path={tmp_path / 'dense'}", "algorithm.routing_replay=r3"])
    with pytest.raises(ConfigError, match="algorithm.routing_replay='r3'.*dense model"):
        check_against_model(cfg)
    check_against_model(
        load_config(None, [f"model.path={tmp_path / 'moe'}", "algorithm.routing_replay=r3"])
    )
    check_against_model(load_config(None, [f"model.path={tmp_path / 'dense'}"]))  # off


# ----------------------------------------------------------------------------- model runs
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    work = tmp_path_factory.mktemp("r3")
    ranks = run_ranks([worker_cmd(WORKER, "single", 0, 1, free_port(), work)], timeout=300, env=ENV)
    return rank_results([work / "single.0.json"], ranks)[0], work


@pytest.fixture(scope="module")
def layouts(single):
    work, port = single[1], free_port()
    ranks = run_ranks(
        [worker_cmd(WORKER, "layouts", r, 2, port, work) for r in range(2)], timeout=300, env=ENV
    )
    return rank_results([work / f"layouts.{r}.json" for r in range(2)], ranks)


def test_routes_from_the_server_reach_the_packed_batch(single):
    res, _ = single
    assert res["routes_shape"] == [28, 4, 2] and res["routes_dtype"] == "torch.int16"
    # -1 rows: each sequence's last token and the trailing padding
    assert res["minus_one_rows"] == res["n_seqs"] + res["n_pad_tokens"] == 11 + 2
    assert res["actor_instances"] == 4 == res["global_instances_added_by_actor"]


def test_identical_weights_replay_equals_free_routing_and_the_hf_model(single):
    res, _ = single
    assert res["same.replay_vs_free"] <= 1e-5
    assert res["same.replay_vs_hf"] <= 1e-5
    agree, rows = res["same.agreement"]
    assert rows == 348 and agree == rows  # 4 layers x 87 routed tokens, all the same
    assert res["targets_cleared"]


def test_router_noise_mismatch_with_r3_is_10x_smaller(single):
    res, _ = single
    m = res["gap.metrics"]
    assert m["moe/route_rows"] == 348 and m["moe/route_agreement"] < 0.95  # routes moved
    assert m["moe/mismatch_free"] >= 10 * m["moe/mismatch_replay"] > 0, m
    assert res["gap.free_vs_hf_all"] >= 10 * res["gap.replay_vs_hf_all"]  # every label
    # replay recomputes the gates from the trainer's own router: its gradient is not zero
    assert all(g > 1e-4 for g in res["grad.router_norms"])


def test_rl_step_reports_the_moe_metrics_and_trains_with_replay(single):
    res, _ = single
    st = res["step.stats"]
    # the loss's mismatch (proximal = replayed) is moe/mismatch_replay, on the same tokens
    assert st["mismatch"] == pytest.approx(st["moe/mismatch_replay"], rel=1e-5)
    assert st["moe/mismatch_free"] >= 10 * st["moe/mismatch_replay"]
    assert st["moe/route_agreement"] == pytest.approx(res["gap.metrics"]["moe/route_agreement"])
    assert st["grad_norm"] > 0 and len(res["step.trained"]) == 1
    assert len(res["step.trained"][0]) == res["n_seqs"]
    # the poisonous sample (an expert twice in one token's top-k) is dropped and counted;
    # the rest of its group trains
    assert st["refused/routes"] == 1.0 and st["refused/samples"] == 1.0
    assert "poison" not in res["step.trained"][0] and st["n_samples"] == res["n_seqs"]


def test_replay_with_activation_recompute_and_stand_ins_for_minus_one_rows(single):
    res, _ = single
    assert res["recompute.grads"] <= 1e-6
    assert res["free.grads_differ"] > 1e-3  # the replay really changed the network
    assert res["minus_one.filler_effect"] <= 1e-5  # last-token/padding rows reach no logprob


def test_reference_model_beside_the_actor_never_replays(single):
    res, _ = single
    assert res["ref.instances_added"] == 0 and not res["ref.replay"]
    assert res["ref.routers_without_replay"]
    assert res["ref.after_actor_vs_hf"] <= 1e-5
    assert "actor only" in res["ref.replay_refused"]


@pytest.mark.parametrize("layout", ["ep2", "tp2sp", "pp2_recompute", "pp2vpp2_recompute"])
def test_layouts_replay_like_one_rank(single, layouts, layout):
    for res in layouts:
        assert res[f"{layout}.logprobs"] <= 1e-5, res
        assert res[f"{layout}.grads_rel"] <= 1e-5, res
        assert res[f"{layout}.loss"] <= 1e-5, res
        # free routing's agreement, counted per rank and summed, equals the single rank's
        assert res[f"{layout}.agreement"] == single[0]["gap.agreement"], res

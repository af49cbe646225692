"""The trainer's entry checks of numbers from outside (rewards, rollout logprobs, MoE routes,
teacher logprobs) and the served teacher's retry after a blip, on real objects."""

import asyncio
import math

import numpy as np
import pytest
import torch
from aiohttp import web

from areal_mega.algo.batch import PackedBatch
from areal_mega.common.moe_routes import RouteLayout, repeated_expert
from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.engine.routing_replay import check_routes as check_packed_routes
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.scoring import score_sequences
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train.batches import next_token_layout
from areal_mega.train.screen import (
    refuse_bad_teacher_rows,
    sample_problem,
    screen_samples,
    teacher_row_problem,
)

LAYOUT = RouteLayout(num_hidden_layers=2, moe_layers=(0, 1), topk=2, num_experts=4)


def _traj(sid="s0", reward=1.0, n=6, routes=True, **kw):
    ids = np.arange(n, dtype=np.int64) + 3
    mask = np.array([0, 0] + [1] * (n - 2), np.int8)
    extras = {}
    if routes:
        r = np.tile(np.array([[0, 1], [2, 3]], np.int32), (n, 1, 1))
        extras["routed_experts"] = r
    return Trajectory(
        input_ids=ids,
        loss_mask=mask,
        logprobs=-np.ones(n, np.float32) * mask,
        versions=np.where(mask > 0, 0, -1).astype(np.int32),
        reward=reward,
        sample_id=sid,
        group_id="g0",
        prompt_len=2,
        token_extras=extras,
        **kw,
    )


def test_good_sample_passes():
    assert sample_problem(_traj(), LAYOUT) is None
    assert sample_problem(_traj(routes=False)) is None


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused_naming_the_workflow(reward):
    src, why = sample_problem(_traj(reward=reward))
    assert src == "rewards" and "workflow" in why


def test_non_finite_rollout_logprob_on_a_loss_token_is_refused():
    t = _traj()
    t.logprobs[3] = math.nan
    assert sample_problem(t)[0] == "rollout_logprobs"
    t = _traj()
    t.logprobs[0] = math.nan  # a prompt token: not trained on, not refused
    assert sample_problem(t) is None


def test_an_expert_twice_in_a_tokens_top_k_is_refused():
    t = _traj()
    t.token_extras["routed_experts"][4, 1] = [3, 3]
    src, why = sample_problem(t, LAYOUT)
    assert src == "routes" and "token 4, MoE layer 1 names expert 3 twice" in why
    assert repeated_expert(t.token_extras["routed_experts"]) == (4, 1, 3)
    no_route = _traj()
    no_route.token_extras["routed_experts"][0] = -1  # rows no server forwarded: fine
    assert sample_problem(no_route, LAYOUT) is None
    with pytest.raises(ValueError, match="names expert 3 twice"):  # the engine's own check
        check_packed_routes(torch.as_tensor(t.token_extras["routed_experts"]), 6, 2, 2, 4)


def test_out_of_range_routes_are_refused():
    t = _traj()
    t.token_extras["routed_experts"][1, 0, 0] = 9
    assert sample_problem(t, LAYOUT)[0] == "routes"


def test_screen_drops_and_counts_the_bad_keeps_the_rest():
    bad_routes = _traj("r")
    bad_routes.token_extras["routed_experts"][2, 0] = [1, 1]
    kept, stats, dropped = screen_samples(
        [_traj("a"), _traj("b", reward=math.nan), bad_routes, _traj("c")], LAYOUT
    )
    assert [t.sample_id for t in kept] == ["a", "c"]
    assert [t.sample_id for t in dropped] == ["b", "r"]
    assert stats == {"refused/rewards": 1.0, "refused/routes": 1.0, "refused/samples": 2.0}
    kept, stats, dropped = screen_samples([_traj("a")], LAYOUT)
    assert [t.sample_id for t in kept] == ["a"] and stats == {} and dropped == []


def test_a_step_whose_every_sample_is_refused_plans_padding_only():
    from areal_mega.config import load_config
    from areal_mega.train.batches import plan_step

    cfg = load_config(None, [])
    kept, _, dropped = screen_samples([_traj("b", reward=math.nan, routes=False)])
    plan = plan_step(kept, cfg, dp_size=1, tp_size=1, pp_size=1, cp_size=1, template=dropped[0])
    assert plan.sample_ids == [] and plan.stats["n_samples"] == 0.0
    (mb,) = plan.micro_batches[0]
    assert int(mb["loss_mask"].sum()) == 0


@pytest.mark.parametrize(
    "vals, bad",
    [
        ([-1.0, -0.5], None),
        ([-1.0, 0.005], None),
        ([-1.0, math.nan], "non-finite"),
        ([-1.0, -math.inf], "non-finite"),
        ([-1.0, 7.0], "7 > 0"),
        ([-1e30, -1.0], "< -10000"),
    ],
)
def test_teacher_row_problem(vals, bad):
    got = teacher_row_problem(torch.tensor(vals))
    assert (got is None) if bad is None else (bad in got), got


def _packed(lens=(5, 7)):
    seqs = []
    for i, n in enumerate(lens):
        ids = np.arange(n) + 3
        mask = np.array([0, 0] + [1] * (n - 2), np.int8)
        seqs.append(
            {
                **next_token_layout(
                    ids,
                    loss_mask=mask,
                    logprobs=-np.ones(n, np.float32),
                    versions=np.zeros(n, np.int32),
                    advantages=np.ones(n, np.float32),
                ),
                "prompt_len": 2,
                "reward": 1.0,
                "sample_id": f"s{i}",
                "group_id": "g",
            }
        )
    return PackedBatch.from_packed(pack_sequences(seqs, pad_to_multiple=4))


def test_bad_teacher_rows_are_dropped_from_the_loss_only():
    mb = _packed()
    lp = -torch.ones(mb.n_tokens)
    start = int(mb.cu_seqlens_padded[1])
    lp[start + 3] = math.nan  # a loss token of the second sequence
    mb = mb.with_fields(teacher_logprobs=lp)
    (out,), refused = refuse_bad_teacher_rows([mb])
    assert refused == [("s1", "non-finite teacher logprobs")]
    assert int(out.loss_mask[start:].sum()) == 0 and torch.isfinite(out.teacher_logprobs).all()
    assert torch.equal(out.loss_mask[:start], mb.loss_mask[:start])
    assert torch.isnan(mb.teacher_logprobs).any()  # the input unchanged
    assert refuse_bad_teacher_rows([out])[1] == []


def test_the_only_teacher_server_is_probed_again_after_a_blip():
    """A real HTTP server, the only teacher: its first scoring request is answered 503 (the
    server is marked down), then it answers; the same score_sequences call gets the answer
    (the retry round probes /health and marks it up) and a later call finds it up. Before,
    the call raised "no teacher server could score" and every later one "no healthy teacher
    server"."""
    calls = {"generate": 0, "health": 0}

    async def generate(request):
        calls["generate"] += 1
        body = await request.json()
        if calls["generate"] == 1:
            return web.Response(status=503, text="overloaded")  # the blip
        seq, start = body["input_ids"][0], body["logprob_start_len"][0] + 1
        entries = [[None, seq[start - 1], ""]] + [[-0.5, t, ""] for t in seq[start:]]
        return web.json_response([{"meta_info": {"input_token_logprobs": entries}}])

    async def health(request):
        calls["health"] += 1
        return web.json_response({})

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        client = RolloutClient([f"127.0.0.1:{port}"], timeout_s=10)
        try:
            import areal_mega.rollout.scoring as scoring

            t0 = asyncio.get_running_loop().time()
            first = await score_sequences(client, [[1, 2, 3, 4]], [2], timeout=10)
            took = asyncio.get_running_loop().time() - t0
            second = await score_sequences(client, [[5, 6, 7]], [1], timeout=10)
            return first, second, took, scoring.RETRY_BACKOFF_S
        finally:
            await client.close()
            await runner.cleanup()

    first, second, took, backoff = asyncio.run(main())
    assert first == [[-0.5, -0.5]] and second == [[-0.5, -0.5]]
    assert calls["generate"] == 3 and calls["health"] >= 1
    assert backoff <= took < backoff + 5

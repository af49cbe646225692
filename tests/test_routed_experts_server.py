"""Routed experts from the CPU rollout server (``--enable-return-routed-experts``) on a tiny
qwen3_moe, as real server processes driven over HTTP: the routes equal the HF model's own
router top-k for prompt and generated tokens, decoded as SGLang's clients decode them; the
answer's format follows SGLang (absent without the flag); an interrupted and resumed
generation through the real client and controller has a route for every token but the last,
equal to a fresh prefill's."""

import base64
import time

import numpy as np
import pytest
import torch

from areal_mega.common.moe_routes import NO_ROUTE, RouteLayout
from areal_mega.inference.process import LocalServerProcess
from areal_mega.inference.server_state import LocalRolloutServer
from areal_mega.models.tiny import make_tiny_model
from areal_mega.rollout.client import RolloutClient, sampling_dict
from areal_mega.rollout.controller import RolloutController
from tests.helpers.rollout import API_KEY, http, load_model, run

pytestmark = pytest.mark.timeout(300)

LAYERS, TOPK, EXPERTS = 3, 2, 8
TIE = 1e-4  # rows whose k-th and (k+1)-th router probabilities are closer are not compared


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    base = tmp_path_factory.mktemp("r3_models")
    path = make_tiny_model(
        base / "moe",
        arch="qwen3_moe",
        hidden_size=32,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        moe_intermediate_size=16,
        seed=3,
    )
    dense = make_tiny_model(base / "dense", arch="qwen3", hidden_size=32, num_layers=1)
    return {"path": path, "model": load_model(path), "dense": dense}


@pytest.fixture(scope="module")
def servers(moe):
    """One server with the flag, one without."""
    on = LocalServerProcess(
        str(moe["path"]), api_key=API_KEY, extra_args=["--enable-return-routed-experts"]
    )
    off = LocalServerProcess(str(moe["path"]), api_key=API_KEY)
    try:
        yield on.wait_ready(), off.wait_ready()
    finally:
        on.stop()
        off.stop()


@torch.no_grad()
def hf_routes(model, ids):
    """The HF model's own router choice for every token of ``ids`` (one full forward): ids
    ``[n, layers, topk]`` and the top-k margin ``[n, layers]``."""
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    probs = torch.stack([torch.softmax(lg.float(), -1) for lg in out.router_logits], 1)
    top = torch.topk(probs, TOPK + 1, dim=-1)
    margin = top.values[..., TOPK - 1] - top.values[..., TOPK]
    return top.indices[..., :TOPK].numpy(), margin.numpy()


def sglang_decode(answer, n_layers=LAYERS, topk=TOPK):
    """What SGLang's clients do with ``meta_info.routed_experts``."""
    flat = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), np.int32)
    return flat.reshape(-1, n_layers, topk)


def assert_routes_match(model, ids, got):
    ref, margin = hf_routes(model, ids)
    assert got.shape == (len(ids) - 1, LAYERS, TOPK)
    clear = margin[: len(ids) - 1] > TIE
    assert clear.mean() > 0.9
    assert np.array_equal(np.asarray(got)[clear], ref[: len(ids) - 1][clear])


def test_routes_equal_the_hf_router_for_prompt_and_output(servers, moe):
    """Three concurrent requests (decoded in one batch, prefilled by length) and one that does
    not ask: each answer's routes are the model's own top-k of its prompt tokens and of every
    generated token but the last, in SGLang's format."""
    on, _ = servers
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]

    async def go():
        import asyncio

        bodies = [
            {
                "input_ids": p,
                "return_routed_experts": True,
                "return_logprob": True,
                "sampling_params": sampling_dict(6 + 3 * i, 0.0, ignore_eos=True),
            }
            for i, p in enumerate(prompts)
        ]
        bodies.append({"input_ids": prompts[0], "sampling_params": sampling_dict(4, 0.0)})
        loop = asyncio.get_running_loop()
        return await asyncio.gather(
            *[loop.run_in_executor(None, http, on, "/generate", b) for b in bodies]
        )

    answers = run(go())
    for i, (status, ans) in enumerate(answers[:3]):
        assert status == 200
        ids = prompts[i] + ans["output_ids"]
        assert len(ans["output_ids"]) == 6 + 3 * i
        assert_routes_match(moe["model"], ids, sglang_decode(ans))
    assert answers[3][0] == 200 and "routed_experts" not in answers[3][1]["meta_info"]
    assert http(on, "/get_server_info")[1]["enable_return_routed_experts"] is True


def test_without_the_flag_the_request_is_served_without_routes(servers):
    _, off = servers
    status, ans = http(
        off,
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "return_routed_experts": True,
            "sampling_params": sampling_dict(3, 0.0),
        },
    )
    assert status == 200 and len(ans["output_ids"]) == 3
    assert "routed_experts" not in ans["meta_info"]
    status, ans = http(off, "/generate", {"input_ids": [5], "return_routed_experts": "yes"})
    assert status == 400 and "return_routed_experts" in ans["error"]["message"]


def test_dense_model_with_the_flag_is_refused(moe):
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        LocalRolloutServer(str(moe["dense"]), enable_return_routed_experts=True)


def test_interrupted_generation_has_routes_for_every_token_but_the_last(servers, moe):
    """The controller's interruptible generate through the real client: a weight-update pause
    aborts the request mid-generation, it resumes with prompt + partial output; the routes
    cover every token but the last and equal a fresh prefill's (same weights): the resumed
    call's routes, which replaced the first call's."""
    on, _ = servers
    layout = RouteLayout.from_model_path(str(moe["path"]))
    client = RolloutClient([on.addr], api_key=API_KEY, timeout_s=120, retries=1)
    ctl = RolloutController(
        client,
        None,
        [],
        batch_size=1,
        n_samples=1,
        eta=0,
        sink=lambda group: None,
        route_layout=layout,
    ).start()
    prompt = [5, 6, 7, 8, 9]
    try:
        for attempt in range(5):
            before = http(on, "/get_server_info")[1]["tokens_generated"]
            fut = ctl.run_async(
                ctl.generate(prompt, 400, key=f"k{attempt}", temperature=0.0, ignore_eos=True)
            )
            while (
                http(on, "/get_server_info")[1]["tokens_generated"] < before + 20 and not fut.done()
            ):
                time.sleep(0.005)
            ctl.begin_weight_update()
            ctl.end_weight_update(attempt + 1)
            gen = fut.result(120)
            if gen.n_interruptions:
                break
        assert gen.n_interruptions >= 1 and len(gen.output_ids) == 400
    finally:
        ctl.stop()
    ids = prompt + gen.output_ids
    routes = gen.routed_experts
    assert routes.shape == (len(ids) - 1, LAYERS, TOPK) and routes.dtype == np.int16
    assert (routes != NO_ROUTE).all()
    status, fresh = http(
        on,
        "/generate",
        {"input_ids": ids, "return_routed_experts": True, "sampling_params": sampling_dict(1, 0.0)},
    )
    assert status == 200
    fresh_rows = sglang_decode(fresh)[: len(ids) - 1]
    ref, margin = hf_routes(moe["model"], ids)
    clear = margin[: len(ids) - 1] > TIE
    assert np.array_equal(routes[clear], fresh_rows[clear])
    assert np.array_equal(routes[clear], ref[: len(ids) - 1][clear])


def test_launchers_start_servers_with_the_flag_when_replay_is_on(tmp_path):
    """``algorithm.routing_replay: r3`` (the 30B-A3B recipe) adds SGLang's flag to every
    server's argv, for SGLang and the CPU server alike; off adds nothing."""
    from pathlib import Path

    from areal_mega.config import load_config
    from areal_mega.launch import local

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "recipes/qwen3-30b-a3b-math.yaml", [f"logging.run_dir={tmp_path}"])
    assert cfg.algorithm.routing_replay == "r3"
    argv = local.server_command(cfg, local.planned_layout(cfg).servers[0])
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--enable-return-routed-experts" in argv
    cpu = load_config(root / "recipes/tiny-cpu.yaml", ["algorithm.routing_replay=r3"])
    slot = local.make_layout(cpu, ports=[1234]).servers[0]
    assert "--enable-return-routed-experts" in local.server_command(cpu, slot)
    off = load_config(root / "recipes/tiny-cpu.yaml")
    assert "--enable-return-routed-experts" not in local.server_command(off, slot)


def test_replay_on_a_dense_model_is_a_config_error(moe):
    from areal_mega.config import ConfigError, config_from_dict
    from areal_mega.rollout.routes import replay_layout

    cfg = config_from_dict(
        {"model": {"path": str(moe["dense"])}, "algorithm": {"routing_replay": "r3"}}
    )
    with pytest.raises(ConfigError, match="algorithm.routing_replay='r3'.*no mixture-of-experts"):
        replay_layout(cfg)
    cfg.model.path = str(moe["path"])
    assert replay_layout(cfg) == RouteLayout(LAYERS, tuple(range(LAYERS)), TOPK, EXPERTS)
    cfg.algorithm.routing_replay = "off"
    assert replay_layout(cfg) is None


def _never_right(prompt, completion, answer, finish_reason="stop"):
    return 0.0


def test_multi_turn_trajectory_routes(servers, moe):
    """The built-in multi-turn workflow through the controller and the real server: turn 2's
    prefill routes the environment tokens; the trajectory's routes are the model's own for
    every token but the last (-1), and int16 of shape (L, layers, topk)."""
    from areal_mega.data.dataset import load_tokenizer
    from areal_mega.workflow.builtin import MultiTurnWorkflow, RetryEnvironment
    from tests.helpers.rollout import GroupSink

    on, _ = servers
    wf = MultiTurnWorkflow(
        lambda: RetryEnvironment(_never_right, feedback="no, again:"),
        max_new_tokens=6,
        max_turns=3,
        apply_chat_template=False,
    )
    sink = GroupSink()
    client = RolloutClient([on.addr], api_key=API_KEY, timeout_s=120, retries=1)
    ctl = RolloutController(
        client,
        wf,
        [{"input_ids": [5, 6, 7, 8], "answer": "x"}],
        batch_size=1,
        n_samples=1,
        eta=0,
        temperature=0.0,
        tokenizer=load_tokenizer(str(moe["path"])),
        sink=sink,
        route_layout=RouteLayout.from_model_path(str(moe["path"])),
        ignore_eos=True,
    ).start()
    try:
        [[traj]] = sink.take(ctl, 1)
    finally:
        ctl.stop()
    traj.validate()
    assert traj.meta["turns"] == 3
    ids = traj.input_ids.tolist()
    routes = traj.token_extras["routed_experts"]
    assert routes.shape == (len(ids), LAYERS, TOPK) and routes.dtype == np.int16
    assert (routes[-1] == NO_ROUTE).all() and (routes[:-1] != NO_ROUTE).all()
    assert_routes_match(moe["model"], ids, routes[:-1])


def test_routed_experts_start_len(servers, moe):
    """SGLang's ``routed_experts_start_len``: the answer starts at that token; out of
    ``[0, prompt length]`` is a 400. The client's decoding accepts an answer from a server that
    ignores the key (older SGLang: the whole sequence) as well."""
    from areal_mega.rollout.generate_result import parse_generate_answer
    from areal_mega.rollout.routes import call_routes

    on, _ = servers
    body = {
        "input_ids": [5, 6, 7, 8, 9],
        "return_routed_experts": True,
        "sampling_params": sampling_dict(4, 0.0, ignore_eos=True),
    }
    _, whole = http(on, "/generate", body)
    status, part = http(on, "/generate", dict(body, routed_experts_start_len=3))
    assert status == 200 and whole["output_ids"] == part["output_ids"]
    assert np.array_equal(sglang_decode(part), sglang_decode(whole)[3:])
    assert sglang_decode(part).shape == (5 + 4 - 1 - 3, LAYERS, TOPK)
    status, err = http(on, "/generate", dict(body, routed_experts_start_len=6))
    assert status == 400 and "routed_experts_start_len=6" in err["error"]["message"]
    layout = RouteLayout.from_model_path(str(moe["path"]))
    rows, first = call_routes(parse_generate_answer(part, on.addr), 5, layout, start=3)
    assert first == 3 and np.array_equal(rows, sglang_decode(part).astype(np.int16))
    rows, first = call_routes(parse_generate_answer(whole, on.addr), 5, layout, start=3)
    assert first == 0 and len(rows) == 8


def test_config_check_refuses_replay_on_a_dense_model(moe):
    from areal_mega.config import ConfigError, check_against_model, config_from_dict

    cfg = config_from_dict(
        {
            "model": {"path": str(moe["dense"])},
            "algorithm": {"routing_replay": "r3"},
            "data": {"max_prompt_len": 64},
            "rollout": {"max_new_tokens": 64},
        }
    )
    with pytest.raises(ConfigError, match="routing_replay='r3'.*set algorithm.routing_replay=off"):
        check_against_model(cfg)
    cfg.model.path = str(moe["path"])
    check_against_model(cfg)

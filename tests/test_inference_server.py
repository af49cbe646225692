"""The CPU rollout server as a real process on a real tiny HF model, driven by the real client."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from areal_mega.rollout.client import RolloutClient, RolloutRequestError, sampling_dict
from areal_mega.train.weight_sender import DistributedWeightSender, plan_weight_buckets
from tests.helpers.rollout import API_KEY, run, teacher_forced_logprobs

pytestmark = pytest.mark.timeout(300)


def client_for(server):
    return RolloutClient([server.addr], api_key=API_KEY, timeout_s=60, retries=1)


def post_raw(server, path, data: bytes, key=API_KEY):
    req = urllib.request.Request(
        f"http://{server.addr}{path}",
        data=data,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check_logprobs(model, prompt, res, temperature=1.0):
    ids = prompt + res.output_ids
    ref = teacher_forced_logprobs(model, ids, len(prompt), temperature)
    assert len(ref) == len(res.logprobs) > 0
    assert max(abs(x - y) for x, y in zip(ref, res.logprobs)) <= 1e-4


def test_logprobs_match_teacher_forcing_batched(server, models):
    """8 concurrent requests of different lengths decode in one batch; every returned logprob
    equals the model's own teacher-forced logprob at the request's temperature."""
    prompts = [[5 + i] * (3 + 2 * i) for i in range(8)]
    temps = [1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 0.9, 1.1]

    async def go():
        c = client_for(server)
        try:
            return await asyncio.gather(
                *[
                    c.generate(
                        p,
                        sampling_dict(
                            20 + 3 * i,
                            t,
                            top_k=40 if i % 2 else -1,
                            top_p=0.95 if i % 3 == 0 else 1.0,
                            ignore_eos=True,
                        ),
                    )
                    for i, (p, t) in enumerate(zip(prompts, temps))
                ]
            )
        finally:
            await c.close()

    results = run(go())
    for i, (p, t, r) in enumerate(zip(prompts, temps, results)):
        assert r.finish_type == "length" and len(r.output_ids) == 20 + 3 * i
        check_logprobs(models["ma"], p, r, t)


def test_greedy_stop_tokens_and_seed(server, models):
    """Greedy is the model's argmax; a stop token id ends generation (and, as on SGLang, is
    ignored together with EOS under ignore_eos); a sampling_seed makes sampling repeatable."""

    async def go():
        c = client_for(server)
        try:
            g1 = await c.generate([7, 8, 9], sampling_dict(12, 0.0, ignore_eos=True))
            g2 = await c.generate([7, 8, 9], sampling_dict(12, 0.0, ignore_eos=True))
            stop = g1.output_ids[3]
            s = await c.generate([7, 8, 9], sampling_dict(12, 0.0, stop_token_ids=[stop]))
            s_ign = await c.generate(
                [7, 8, 9], sampling_dict(12, 0.0, stop_token_ids=[stop], ignore_eos=True)
            )
            r1 = await c.generate([7, 8], sampling_dict(10, 1.0, sampling_seed=3))
            r2 = await c.generate([7, 8], sampling_dict(10, 1.0, sampling_seed=3))
            return g1, g2, s, s_ign, stop, r1, r2
        finally:
            await c.close()

    g1, g2, s, s_ign, stop, r1, r2 = run(go())
    assert g1.output_ids == g2.output_ids
    ids = [7, 8, 9]
    for tok in g1.output_ids:  # greedy = argmax of the model
        with torch.no_grad():
            nxt = int(models["ma"](input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        assert nxt == tok
        ids.append(tok)
    eos = models["ma"].config.eos_token_id
    first = next(i for i, t in enumerate(g1.output_ids) if t in (stop, eos))
    assert s.output_ids == g1.output_ids[: first + 1]
    assert s.finish_reason == {"type": "stop", "matched": g1.output_ids[first]}
    assert s_ign.output_ids == g1.output_ids and s_ign.finish_type == "length"
    assert r1.output_ids == r2.output_ids


def test_bad_input_answered_400_and_server_keeps_serving(server):
    cases = [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"input_ids": [1, 2], "image_data": "x.png"}).encode(), "image_data"),
        (
            json.dumps({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}).encode(),
            "unknown field",
        ),
        (
            json.dumps(
                {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 100}}
            ).encode(),
            "too long",
        ),
        (json.dumps({"input_ids": [1, 100000]}).encode(), "token ids"),
        (json.dumps({"input_ids": []}).encode(), "input_ids"),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}).encode(),
            "max_new_tokens",
        ),
        (json.dumps({"input_ids": [1], "sampling_params": {"top_p": 0}}).encode(), "top_p"),
        (json.dumps({"input_ids": [1], "sampling_params": {"regex": "a+"}}).encode(), "regex"),
        (json.dumps({"input_ids": [1], "sampling_params": {"min_p": 2}}).encode(), "min_p"),
        (json.dumps({"input_ids": [1], "stream": True}).encode(), "stream"),
    ]
    for data, msg in cases:
        status, body = post_raw(server, "/generate", data)
        assert status == 400, (data, body)
        assert msg in body["error"]["message"], (msg, body)
    status, body = post_raw(
        server, "/update_weights_from_disk", json.dumps({"model_path": "/nonexistent"}).encode()
    )
    assert status == 400 and "not a directory" in body["error"]["message"]
    status, body = post_raw(
        server,
        "/update_weights_from_distributed",
        json.dumps({"names": [], "dtypes": [], "shapes": [], "group_name": "nope"}).encode(),
    )
    assert status == 400 and "not initialised" in body["error"]["message"]
    status, body = post_raw(server, "/generate", b'{"input_ids": [1]}', key="wrong")
    assert status == 401
    status, body = post_raw(
        server,
        "/generate",
        json.dumps(
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        ).encode(),
    )
    assert status == 200 and len(body["output_ids"]) == 3
    assert server.alive()

    async def go():  # the client raises RolloutRequestError (no retry) on 4xx
        c = client_for(server)
        try:
            with pytest.raises(RolloutRequestError, match="too long"):
                await c.generate([5] * 600, sampling_dict(10))
        finally:
            await c.close()

    run(go())


def server_info(server) -> dict:
    req = urllib.request.Request(
        f"http://{server.addr}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_pause_aborts_with_partial_output_then_continue(server, models):
    async def go():
        c = client_for(server)
        try:
            steps0 = server_info(server)["decode_steps"]
            tasks = [
                asyncio.create_task(
                    c.generate([9, 10 + i], sampling_dict(400, 1.0, ignore_eos=True))
                )
                for i in range(3)
            ]
            # pause mid-generation: once all three run and have decoded a few tokens (a fixed
            # sleep is not enough: on a quiet machine 400 tokens take well under a second)
            for _ in range(2000):
                info = await asyncio.to_thread(server_info, server)
                if info["num_running"] == 3 and info["decode_steps"] - steps0 >= 3:
                    break
                await asyncio.sleep(0.005)
            await c.pause()
            parts = await asyncio.gather(*tasks)
            # while paused, a new request waits; it runs after continue
            late = asyncio.create_task(c.generate([9], sampling_dict(4, 1.0, ignore_eos=True)))
            await asyncio.sleep(0.3)
            assert not late.done()
            await c.resume()
            return parts, await late
        finally:
            await c.close()

    parts, late = run(go())
    for i, r in enumerate(parts):
        assert r.finish_type == "abort" and 0 < len(r.output_ids) < 400
        check_logprobs(models["ma"], [9, 10 + i], r)
    assert len(late.output_ids) == 4


def _logprobs_of(server, prompt, n=16):
    async def go():
        c = client_for(server)
        try:
            return await c.generate(prompt, sampling_dict(n, 1.0, ignore_eos=True))
        finally:
            await c.close()

    return run(go())


def test_update_weights_from_disk(server, models):
    async def upd(path, v):
        c = client_for(server)
        try:
            await c.update_weights_from_disk(str(path), weight_version=v)
            return await c.model_info()
        finally:
            await c.close()

    info = run(upd(models["b"], 7))
    assert info["weight_version"] == "7"
    r = _logprobs_of(server, [11, 12, 13])
    assert r.weight_version == "7"
    check_logprobs(models["mb"], [11, 12, 13], r)
    run(upd(models["a"], 0))
    check_logprobs(models["ma"], [11, 12, 13], _logprobs_of(server, [11, 12, 13]))


def test_update_weights_from_distributed_gloo_buckets(server, models):
    """The trainer side broadcasts model B's tensors in several buckets over gloo; the server
    then answers with exactly model B's logprobs."""
    named = [(n, p.detach().clone()) for n, p in models["mb"].named_parameters()]
    bucket_bytes = 40_000
    plan = plan_weight_buckets([(n, t.shape, t.dtype) for n, t in named], bucket_bytes)
    assert len(plan) >= 3
    client = client_for(server)
    sender = DistributedWeightSender(
        client, backend="gloo", group_name="test_dist_1", bucket_bytes=bucket_bytes, timeout_s=60
    )
    sender.connect()
    n = sender.send(iter(named), weight_version=3)
    assert n == len(plan)
    r = _logprobs_of(server, [20, 21, 22])
    assert r.weight_version == "3"
    check_logprobs(models["mb"], [20, 21, 22], r)
    # a bucket with an unknown name is refused with 400 yet the group stays in sync
    with pytest.raises(RolloutRequestError, match="unknown parameter"):
        sender.send(iter([("not.a.param", torch.zeros(3))]))
    sender.send(
        iter((n_, p.detach().clone()) for n_, p in models["ma"].named_parameters()),
        weight_version=0,
    )
    sender.close()
    check_logprobs(models["ma"], [20, 21, 22], _logprobs_of(server, [20, 21, 22]))

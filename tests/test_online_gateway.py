"""The online gateway against a real CPU rollout server, driven by a real RolloutController,
through HTTP and the official ``openai`` package: hostile input (missing and wrong keys,
another session's key, malformed bodies, NaN / inf / out-of-range rewards, 1,000 sessions
opened at once) each answered with a clear 4xx/503 while the run goes on, and the recorded
tokens, logprobs and versions of every session equal the servers' raw answers and what the
agent was sent, bit for bit, across a weight update in the middle of the sessions."""

import asyncio
import json
import os
import stat
import threading

import aiohttp
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from areal_mega.config import OnlineConfig
from areal_mega.workflow.api import WorkflowSettings
from areal_mega.workflow.online_gateway import INFO_FILE, OnlineWorkflow
from tests.helpers.openai_episodes import (
    HERMES_TEMPLATE,
    NO_SPECIAL,
    controller,
    load_weights,
    post,
    server_tokens,
    wait_for,
)
from tests.helpers.rollout import GroupSink, http

pytestmark = pytest.mark.timeout(300)


async def flood(addr, key, n):
    """``n`` start_session requests at once; [(status, Retry-After, message)]."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as s:

        async def one(i):
            async with s.post(
                f"http://{addr}/rl/start_session",
                json={"task_id": f"f{i}"},
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                return r.status, r.headers.get("Retry-After"), (await r.json())["error"]["message"]

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_hostile_input_and_exact_recording_across_a_weight_update(server, models, tmp_path):
    tok = AutoTokenizer.from_pretrained(models["a"])
    tok.chat_template = HERMES_TEMPLATE
    wf = OnlineWorkflow(
        OnlineConfig(max_abs_reward=10.0, max_open_sessions=4), n_samples=2, run_dir=str(tmp_path)
    )
    wf.settings = WorkflowSettings(max_new_tokens=48)
    sink = GroupSink()
    ctl = controller(server.addr, wf, tok, sink, n_prompts=100, batch_size=2, n_samples=2).start()
    try:
        wait_for(lambda: (tmp_path / INFO_FILE).exists() and len(wf.book.free_slots) == 2)
        info = json.loads((tmp_path / INFO_FILE).read_text())
        assert stat.S_IMODE(os.stat(tmp_path / INFO_FILE).st_mode) == 0o600
        addr, admin = info["base_url"][len("http://") :], info["admin_api_key"]
        assert addr.startswith("127.0.0.1:")
        # keys
        for key in ("", "sk-wrong"):
            st, ans = post(addr, "/rl/start_session", {"task_id": "A"}, key)
            assert st == 401 and "admin key" in ans["error"]["message"]
        # malformed bodies
        assert post(addr, "/rl/start_session", b"{nope", admin)[0] == 400
        assert post(addr, "/rl/start_session", b"[1]", admin)[0] == 400
        st, ans = post(addr, "/rl/start_session", {"task_id": 5}, admin)
        assert st == 400 and ans["error"]["param"] == "task_id"
        sess = {}
        for name, task in (("a1", "A"), ("a2", "A"), ("b1", "B")):
            st, sess[name] = post(addr, "/rl/start_session", {"task_id": task}, admin)
            assert st == 200, sess[name]
        st, _ = post(addr, "/rl/start_session", {"task_id": "A"}, sess["a1"]["api_key"])
        assert st == 401  # a session key is no admin key
        # 1,000 sessions at once: no group may start (staleness bound), each a clear 429
        out = asyncio.run(flood(addr, admin, 1000))
        assert {(s, ra) for s, ra, _ in out} == {(429, "1")}
        assert "staleness bound" in out[0][2]
        st, sess["b2"] = post(addr, "/rl/start_session", {"task_id": "B"}, admin)
        assert st == 200
        st, ans = post(addr, "/rl/start_session", {"task_id": "B"}, admin)
        assert st == 503 and "max_open_sessions" in ans["error"]["message"]
        # a session's key on the model routes only; another session's key is refused
        for key in ("", "sk-wrong", admin):
            assert http(addr, "/v1/models", key=key)[0] == 401
        assert http(addr, "/v1/models", key=sess["a1"]["api_key"])[0] == 200
        st, ans = post(
            addr,
            "/rl/set_reward",
            {"session_id": sess["b1"]["session_id"], "reward": 1.0},
            sess["a1"]["api_key"],
        )
        assert st == 403 and "another session" in ans["error"]["message"]
        a1 = sess["a1"]["session_id"]
        for body, status, param in (
            (b'{"session_id": "%s", "reward": NaN}' % a1.encode(), 422, "reward"),
            (b'{"session_id": "%s", "reward": -Infinity}' % a1.encode(), 422, "reward"),
            ({"session_id": a1, "reward": 1e9}, 422, "reward"),
            ({"session_id": a1, "reward": "1"}, 400, "reward"),
            ({"session_id": a1}, 400, "reward"),
            ({"reward": 1.0}, 400, "session_id"),
            ({"session_id": "sess-none", "reward": 1.0}, 404, "session_id"),
            (b"not json", 400, None),
        ):
            st, ans = post(addr, "/rl/set_reward", body, admin)
            assert (st, ans["error"]["param"]) == (status, param), (body, ans)

        # the four sessions talk to the model; a weight update lands mid-answer
        clients = {
            n: openai.OpenAI(
                base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=120
            )
            for n, s in sess.items()
        }
        answers, msgs = {}, {n: [{"role": "user", "content": f"{n} says"}] for n in sess}

        def talk(n):
            answers[n] = [
                clients[n].chat.completions.create(
                    model="policy",
                    messages=msgs[n],
                    max_tokens=48,
                    logprobs=True,
                    logit_bias=NO_SPECIAL,
                )
            ]

        threads = [threading.Thread(target=talk, args=(n,)) for n in sess]
        for t in threads:
            t.start()
        wait_for(lambda: ctl.n_inflight_requests >= 4)
        base = server_tokens(server.addr)
        wait_for(lambda: server_tokens(server.addr) - base >= 16)
        ctl.update_weights(1, path=str(models["b"]))
        for t in threads:
            t.join(120)
        # a1 goes on after the update (one chained sequence); b2 also calls /v1/completions
        msgs["a1"] += [
            {"role": "assistant", "content": answers["a1"][0].choices[0].message.content},
            {"role": "user", "content": " more"},
        ]
        talk_a1 = clients["a1"].chat.completions.create(
            model="policy", messages=msgs["a1"], max_tokens=8, logprobs=True, logit_bias=NO_SPECIAL
        )
        answers["a1"].append(talk_a1)
        cb2 = clients["b2"].completions.create(
            model="policy", prompt="b2", max_tokens=6, logprobs=1
        )
        # rewards: after the end (admin, as a separate rewarder would), before the end (own
        # key), per completion
        key = {n: s["api_key"] for n, s in sess.items()}
        sid = {n: s["session_id"] for n, s in sess.items()}
        assert post(addr, "/rl/end_session", {"session_id": sid["a1"]}, key["a1"])[0] == 200
        assert clients["a1"].models.list()  # still authenticated, but ended:
        with pytest.raises(openai.APIStatusError) as e:
            clients["a1"].completions.create(model="policy", prompt="x", max_tokens=2)
        assert e.value.status_code == 409 and "ended" in e.value.body["message"]
        assert (
            post(addr, "/rl/set_reward", {"session_id": sid["a1"], "reward": 1.0}, admin)[0] == 200
        )
        assert (
            post(addr, "/rl/set_reward", {"session_id": sid["a2"], "reward": -1.0}, key["a2"])[0]
            == 200
        )
        assert post(addr, "/rl/end_session", {"session_id": sid["a2"]}, admin)[0] == 200
        assert post(addr, "/rl/end_session", {"session_id": sid["b1"]}, admin)[0] == 200
        assert (
            post(addr, "/rl/set_reward", {"session_id": sid["b1"], "reward": 0.5}, admin)[0] == 200
        )
        st, ans = post(
            addr,
            "/rl/set_reward",
            {"session_id": sid["b2"], "reward": 0.25, "completion_id": "cmpl-none"},
            admin,
        )
        assert st == 404 and ans["error"]["param"] == "completion_id"
        for cid, r in ((answers["b2"][0].id, 2.0), (cb2.id, 3.0)):
            assert (
                post(
                    addr,
                    "/rl/set_reward",
                    {"session_id": sid["b2"], "reward": r, "completion_id": cid},
                    admin,
                )[0]
                == 200
            )
        assert post(addr, "/rl/end_session", {"session_id": sid["b2"]}, key["b2"])[0] == 200
        groups = sink.take(ctl, 2, timeout=60)
        # trained: a late reward, an end, a call are refused with a clear error
        st, ans = post(addr, "/rl/set_reward", {"session_id": sid["a1"], "reward": 0.0}, admin)
        assert st == 409 and "already trained" in ans["error"]["message"]
        assert post(addr, "/rl/end_session", {"session_id": sid["b2"]}, key["b2"])[0] == 409
        # the run goes on: version 1 lets two more groups start
        wait_for(lambda: len(wf.book.free_slots) == 2)
        assert post(addr, "/rl/start_session", {"task_id": "C"}, admin)[0] == 200
    finally:
        ctl.stop()
        load_weights(server.addr, models["a"])
    by_session = {}
    for g in groups:
        assert len({t.meta["task_id"] for t in g}) == 1
        for t in g:
            by_session.setdefault(t.meta["session_id"], []).append(t)
    assert {n: [t.reward for t in by_session[sid[n]]] for n in sess} == {
        "a1": [1.0],
        "a2": [-1.0],
        "b1": [0.5],
        "b2": [2.0, 3.0],
    }
    assert by_session[sid["a1"]][0].meta["chained"]
    assert [t.sample_id for t in by_session[sid["b2"]]] == [
        sess["b2"]["sample_id"] + "-c0",
        sess["b2"]["sample_id"] + "-c1",
    ]
    switched = 0
    for n in sess:
        trajs = by_session[sid[n]]
        mask = np.concatenate([t.loss_mask.astype(bool) for t in trajs])
        ids = np.concatenate([t.input_ids for t in trajs])[mask].tolist()
        lps = np.concatenate([t.logprobs for t in trajs])[mask]
        vers = np.concatenate([t.versions for t in trajs])[mask].tolist()
        # the servers' raw answers for this session, in order (turn, segment)
        mine = [
            res for rid, res in ctl.client.answers if rid.startswith(sess[n]["sample_id"] + "-t")
        ]
        assert ids == [i for res in mine for i in res.raw["output_ids"]]
        assert np.array_equal(
            lps,
            np.asarray(
                [x[0] for res in mine for x in res.raw["meta_info"]["output_token_logprobs"]],
                dtype=np.float32,
            ),
        )
        assert vers == [int(res.weight_version) for res in mine for _ in res.output_ids]
        # and what the agent was sent
        sent = [c.logprob for a in answers[n] for c in a.choices[0].logprobs.content]
        if n == "b2":
            sent += cb2.choices[0].logprobs.token_logprobs
        assert np.array_equal(lps, np.asarray(sent, dtype=np.float32))
        switched += len(set(vers)) == 2
    assert switched >= 1 and ctl.stats()["interruptions"] >= 1


def test_gateway_serves_https_with_the_configured_certificate(tmp_path):
    """``tls_cert`` / ``tls_key``: the gateway speaks HTTPS only (a client that trusts the
    certificate opens a session; plain HTTP gets no answer)."""
    import ssl
    import subprocess

    from areal_mega.rollout.controller import GroupContext, RolloutController

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    wf = OnlineWorkflow(
        OnlineConfig(tls_cert=str(cert), tls_key=str(key)), n_samples=2, run_dir=str(tmp_path)
    )
    ctl = RolloutController(None, wf, [], batch_size=1, n_samples=2, eta=0, sink=print)

    async def go():
        slot = asyncio.ensure_future(wf.arun_episode(GroupContext(ctl, 0), {}, 2))
        while not wf.book.free_slots:
            await asyncio.sleep(0.01)
        info = json.loads((tmp_path / INFO_FILE).read_text())
        assert info["base_url"].startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as s:
            async with s.post(
                info["base_url"] + "/rl/start_session",
                json={"task_id": "t"},
                headers={"Authorization": f"Bearer {info['admin_api_key']}"},
                ssl=trust,
            ) as r:
                assert r.status == 200 and (await r.json())["base_url"].startswith("https://")
            with pytest.raises(aiohttp.ClientError):
                async with s.post(
                    info["base_url"].replace("https", "http") + "/rl/start_session",
                    json={"task_id": "t"},
                ) as r:
                    await r.read()
        slot.cancel()
        await wf.close()

    asyncio.run(asyncio.wait_for(go(), 60))

"""Sessions ended before their reward survive a restart of the rollout worker's gateway: a
real CPU rollout server, a real RolloutController and the official ``openai`` package. The
first gateway stops with one session done (ended, rewarded), one ended and waiting for its
reward, and one still open; the gateway started after it on the same run directory accepts
the waiting session's reward (with the session's own key), answers the open one's with a
clear 410, and delivers the prompt's group with both sessions under their original ids,
tokens and logprobs exactly as the agent was answered before the restart. (The SIGKILL of a
real rollout worker is ``tests/test_e2e_online.py``.)"""

import json

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from areal_mega.config import OnlineConfig
from areal_mega.rollout.controller import RolloutController
from areal_mega.workflow.api import WorkflowSettings
from areal_mega.workflow.online_gateway import INFO_FILE, OnlineWorkflow
from tests.helpers.openai_episodes import NO_SPECIAL, RecordingClient, post, wait_for
from tests.helpers.rollout import API_KEY, GroupSink

pytestmark = pytest.mark.timeout(300)


def _gateway(tmp_path, server, tok, resume, accepted=None):
    wf = OnlineWorkflow(
        OnlineConfig(reward_timeout_s=120.0), n_samples=2, run_dir=str(tmp_path), resume=resume
    )
    if accepted is not None:  # the resume plan, before the controller starts (the worker)
        wf.retired = wf.retire_accepted(accepted)
    wf.settings = WorkflowSettings(max_new_tokens=8)
    sink = GroupSink()
    items = [
        {"prompt": f"p{k}", "answer": "", "prompt_index": k}
        for k in range(100)
        if k not in (accepted or ())
    ]  # the resume plan: the positions not accepted
    ctl = RolloutController(
        RecordingClient([server.addr], api_key=API_KEY, timeout_s=120, retries=2),
        wf,
        items,
        batch_size=2,
        n_samples=2,
        eta=0,
        sink=sink,
        tokenizer=tok,
        ignore_eos=True,
    ).start()

    def up():
        ctl.raise_if_failed()
        f = tmp_path / INFO_FILE
        return wf.port and f.exists() and f":{wf.port}" in f.read_text()

    wait_for(up)
    info = json.loads((tmp_path / INFO_FILE).read_text())
    return wf, ctl, sink, info["base_url"][len("http://") :], info["admin_api_key"]


def test_an_ended_session_gets_its_reward_after_a_restart(server, models, tmp_path):
    tok = AutoTokenizer.from_pretrained(models["a"])
    wf, ctl, _, addr, admin = _gateway(tmp_path, server, tok, resume=False)
    sess, sent = {}, {}
    try:
        wait_for(lambda: len(wf.book.free_slots) == 2)
        for name, task in (("done", "A"), ("waiting", "A"), ("open", "B")):
            st, sess[name] = post(addr, "/rl/start_session", {"task_id": task}, admin)
            assert st == 200, sess[name]
        for name in ("done", "waiting"):
            c = openai.OpenAI(
                base_url=sess[name]["base_url"],
                api_key=sess[name]["api_key"],
                max_retries=0,
                timeout=120,
            )
            ans = c.chat.completions.create(
                model="policy",
                max_tokens=8,
                logprobs=True,
                messages=[{"role": "user", "content": name}],
                logit_bias=NO_SPECIAL,
            )
            sent[name] = [x.logprob for x in ans.choices[0].logprobs.content]
            sid, key = sess[name]["session_id"], sess[name]["api_key"]
            assert post(addr, "/rl/end_session", {"session_id": sid}, key)[0] == 200
        st, ans = post(
            addr, "/rl/set_reward", {"session_id": sess["done"]["session_id"], "reward": 1.0}, admin
        )
        assert (st, ans["state"]) == (200, "done")
    finally:
        ctl.stop()  # the group of task A never became ready: nothing delivered
    # the next gateway on the same run directory
    wf2, ctl2, sink2, addr2, admin2 = _gateway(tmp_path, server, tok, resume=True)
    try:
        assert set(wf2.restored) == {sess["waiting"]["session_id"]}
        st, ans = post(
            addr2,
            "/rl/set_reward",
            {"session_id": sess["open"]["session_id"], "reward": 1.0},
            admin2,
        )
        assert st == 410 and "dropped" in ans["error"]["message"]
        st, ans = post(
            addr2,
            "/rl/set_reward",
            {"session_id": sess["waiting"]["session_id"], "reward": float("inf")},
            sess["waiting"]["api_key"],
        )
        assert st == 422
        st, ans = post(
            addr2,
            "/rl/set_reward",
            {"session_id": sess["done"]["session_id"], "reward": 0.0},
            sess["waiting"]["api_key"],
        )
        assert st == 403  # its key is still its own only
        st, ans = post(
            addr2,
            "/rl/set_reward",
            {"session_id": sess["waiting"]["session_id"], "reward": 0.5},
            sess["waiting"]["api_key"],
        )
        assert (st, ans["state"]) == (200, "done")
        group = sink2.take(ctl2, 1, timeout=60)[0]
        # delivered: a further reward is refused as for a live session (409), not unknown
        for name in ("waiting", "done"):
            st, ans = post(
                addr2,
                "/rl/set_reward",
                {"session_id": sess[name]["session_id"], "reward": 0.25},
                admin2,
            )
            assert st == 409 and "already trained" in ans["error"]["message"], (name, ans)
    finally:
        ctl2.stop()
    by_session = {t.meta["session_id"]: t for t in group}
    assert set(by_session) == {sess["done"]["session_id"], sess["waiting"]["session_id"]}
    for name, reward in (("done", 1.0), ("waiting", 0.5)):
        t = by_session[sess[name]["session_id"]]
        assert t.sample_id == sess[name]["sample_id"] and t.reward == reward
        lps = t.logprobs[t.loss_mask.astype(bool)]
        assert np.array_equal(lps, np.asarray(sent[name], dtype=np.float32))
    assert len({t.group_id for t in group}) == 1


def _talk(addr, sess, text):
    c = openai.OpenAI(
        base_url=sess["base_url"], api_key=sess["api_key"], max_retries=0, timeout=120
    )
    c.chat.completions.create(
        model="policy",
        max_tokens=8,
        logit_bias=NO_SPECIAL,
        messages=[{"role": "user", "content": text}],
    )
    assert (
        post(addr, "/rl/end_session", {"session_id": sess["session_id"]}, sess["api_key"])[0] == 200
    )


def test_a_restart_retires_the_sessions_the_trainer_accepted(server, models, tmp_path):
    """Task A's group (two sessions) is delivered and accepted by the trainer; task B has one
    session done and one waiting for its reward when the gateway stops. The next gateway,
    given the trainer's accepted prompts, keeps only task B's two sessions (the journal
    shrinks on disk) and delivers B's group with both once the reward comes."""
    tok = AutoTokenizer.from_pretrained(models["a"])
    wf, ctl, sink, addr, admin = _gateway(tmp_path, server, tok, resume=False)
    sess = {}
    try:
        wait_for(lambda: len(wf.book.free_slots) == 2)
        for name, task in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B")):
            st, sess[name] = post(addr, "/rl/start_session", {"task_id": task}, admin)
            assert st == 200, sess[name]
            _talk(addr, sess[name], name)
        for name in ("a1", "a2", "b1"):
            assert (
                post(
                    addr,
                    "/rl/set_reward",
                    {"session_id": sess[name]["session_id"], "reward": 1.0},
                    admin,
                )[0]
                == 200
            )
        [group_a] = sink.take(ctl, 1, timeout=60)
    finally:
        ctl.stop()
    accepted = {group_a[0].meta["prompt_index"]}  # the trainer's ledger holds task A
    assert {t.meta["session_id"] for t in group_a} == {
        sess["a1"]["session_id"],
        sess["a2"]["session_id"],
    }
    wf2, ctl2, sink2, addr2, admin2 = _gateway(
        tmp_path, server, tok, resume=True, accepted=accepted
    )
    try:
        info = wf2.retired
        assert info["sessions_kept"] == 2 and info["positions_kept"] == 1, info
        assert info["bytes_after"] < info["bytes_before"], info
        assert set(wf2.restored) == {sess["b2"]["session_id"]}
        assert (
            post(
                addr2,
                "/rl/set_reward",
                {"session_id": sess["b2"]["session_id"], "reward": 0.5},
                sess["b2"]["api_key"],
            )[0]
            == 200
        )
        group_b = sink2.take(ctl2, 1, timeout=60)[0]
    finally:
        ctl2.stop()
    assert {t.meta["session_id"]: t.reward for t in group_b} == {
        sess["b1"]["session_id"]: 1.0,
        sess["b2"]["session_id"]: 0.5,
    }
    assert group_b[0].meta["prompt_index"] not in accepted


def test_an_ended_sessions_journal_record_round_trips_exactly():
    """The journal record of an ended session (JSON) gives back its completions exactly:
    logprobs as the same floats, routing-replay routes with their dtype and shape."""
    from types import SimpleNamespace

    from areal_mega.workflow.online_restore import ended_record, key_digest, restored_sessions
    from areal_mega.workflow.openai_client import CompletionRecord

    routes = np.arange(24, dtype=np.int16).reshape(4, 3, 2) - 1
    recs = [
        CompletionRecord(
            [1, 2],
            [3, 4],
            [-0.1234567890123, -2.5e-7],
            [0, 1],
            "stop",
            server="s0",
            completion_id="chatcmpl-x-0",
            routed_experts=routes,
        ),
        CompletionRecord([1, 2, 3, 4, 9], [5], [-1.0], [1], "length", completion_id="chatcmpl-y-0"),
    ]
    sample = SimpleNamespace(
        item={"prompt_index": 7},
        sample_id="run-g3-s1",
        group_id="run-g3",
        client=SimpleNamespace(records=recs),
    )
    session = SimpleNamespace(
        session_id="sess-1", task_id="T", reward=None, completion_rewards={"chatcmpl-x-0": 0.5}
    )
    rec = json.loads(json.dumps(ended_record(session, sample, "sk-key")))
    assert rec["key_sha256"] == key_digest("sk-key") and "sk-key" not in json.dumps(rec)
    r = restored_sessions([rec], reward_timeout_s=5.0, now=100.0)["sess-1"]
    assert r.deadline == 105.0 and not r.has_reward()
    assert r.records[0].logprobs == recs[0].logprobs and r.records[1] == recs[1]
    got = r.records[0].routed_experts
    assert got.dtype == np.int16 and np.array_equal(got, routes)
    r.set_reward(1.0, "chatcmpl-y", max_abs=10.0)  # a response id covers its choices
    assert r.has_reward()
    trajs = r.trajectories(turn_discount=1.0)
    assert [t.sample_id for t in trajs] == ["run-g3-s1-c0", "run-g3-s1-c1"]
    assert [t.reward for t in trajs] == [0.5, 1.0] and trajs[0].group_id == "run-g3"
    assert trajs[1].meta["prompt_index"] == 7 and trajs[1].meta["restored"]


def test_an_ended_session_with_images_round_trips_through_the_journal():
    """A completion whose prompt held images is journaled with the images as the agent sent
    them (data URLs, never the decoded pictures, which JSON cannot hold); restored after a
    restart, its trajectory carries the same pixels and grid as the live session's would
    (the policy's image processor), and the URLs for a served teacher."""
    from types import SimpleNamespace

    from PIL import Image

    from areal_mega.data.vision_prompts import png_data_url
    from areal_mega.models.vlm.tiny import image_processor
    from areal_mega.workflow.episode_export import record_images
    from areal_mega.workflow.online_restore import ended_record, restored_sessions
    from areal_mega.workflow.openai_client import CompletionRecord

    rng = np.random.default_rng(0)
    pics = [Image.fromarray(rng.integers(0, 255, (28 * k, 56, 3), dtype=np.uint8)) for k in (1, 2)]
    urls = [png_data_url(p) for p in pics]
    rec = CompletionRecord(
        [1, 2, 3],
        [4, 5],
        [-0.5, -0.25],
        [0, 0],
        "stop",
        completion_id="chatcmpl-i-0",
        images=pics,
        image_data=urls,
    )
    sample = SimpleNamespace(
        item={"prompt_index": 3},
        sample_id="run-g1-s0",
        group_id="run-g1",
        client=SimpleNamespace(records=[rec]),
    )
    session = SimpleNamespace(session_id="s-img", task_id="T", reward=None, completion_rewards={})
    text = json.dumps(ended_record(session, sample, "sk-img"))
    assert "base64" in text and len(json.loads(text)["records"][0]["image_data"]) == 2
    r = restored_sessions([json.loads(text)], reward_timeout_s=5.0, now=0.0)["s-img"]
    assert [np.asarray(p).tolist() for p in r.records[0].images] == [
        np.asarray(p).tolist() for p in pics
    ]
    r.set_reward(1.0, None, max_abs=10.0)
    with pytest.raises(ValueError, match="no image processor"):
        r.trajectories(turn_discount=1.0)
    proc = image_processor()
    [t] = r.trajectories(turn_discount=1.0, image_processor=proc)
    live, meta = record_images(SimpleNamespace(image_processor=proc), rec)
    assert np.array_equal(t.multimodal["pixel_values"], live["pixel_values"])
    assert np.array_equal(t.multimodal["image_grid_thw"], live["image_grid_thw"])
    assert t.meta["image_data"] == urls == meta["image_data"] and t.reward == 1.0

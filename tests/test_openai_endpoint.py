"""The OpenAI-compatible surface against a real CPU rollout server, driven by a real
RolloutController: the in-process client in a chained two-call episode interrupted by a weight
update (the exported trajectory equals the servers' answers bit for bit, versions exact), and
the HTTP endpoint through the official ``openai`` package (chat, completions, n > 1, a
tool-call round trip, models, bad key, malformed messages, streaming refused)."""

import asyncio
import queue
import threading

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from areal_mega.workflow.api import WorkflowSettings, build_workflow
from areal_mega.workflow.tool_calls import messages_for_template
from tests.helpers.openai_episodes import (
    HERMES_TEMPLATE,
    NO_SPECIAL,
    controller,
    load_weights,
    server_tokens,
    wait_for,
)
from tests.helpers.rollout import GroupSink

pytestmark = pytest.mark.timeout(300)


@torch.no_grad()
def biased_logprobs(model, ids):
    """Teacher-forced log p(ids[t] | ids[:t]) for t >= 1 under the NO_SPECIAL logit bias (the
    server reports logprobs of the distribution it sampled from, bias included)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    for k, v in NO_SPECIAL.items():
        logits[:, int(k)] += v
    lp = torch.log_softmax(logits, -1)
    return [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]


async def chat_twice(ctx, item, max_tokens=60):
    """Two chained chat calls: the second conversation extends the first exactly."""
    msgs = [{"role": "user", "content": item["prompt"]}]
    for _ in range(2):
        r = await ctx.client.chat.completions.create(
            model="policy", messages=msgs, max_tokens=max_tokens, logit_bias=NO_SPECIAL
        )
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": " ok? "},
        ]
    return 1.0


def test_chained_episode_exact_across_weight_update(server, models):
    tok = AutoTokenizer.from_pretrained(models["a"])
    wf = build_workflow(chat_twice, {}, WorkflowSettings())
    sink = GroupSink()
    ctl = controller(server.addr, wf, tok, sink, n_prompts=8, batch_size=2, n_samples=2).start()
    try:
        # interrupt while all four samples are inside their first call, a few tokens in
        wait_for(lambda: ctl.n_inflight_requests >= 4)
        base = server_tokens(server.addr)
        wait_for(lambda: server_tokens(server.addr) - base >= 16)
        ctl.update_weights(1, path=str(models["b"]))
        groups = sink.take(ctl, 2, timeout=120)
    finally:
        ctl.stop()
        load_weights(server.addr, models["a"])
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 4  # chained: one sequence per sample
    switched = 0
    for t in trajs:
        assert t.meta["chained"] and t.meta["n_calls"] == 2 and t.reward == 1.0
        mask = t.loss_mask.astype(bool)
        assert int(mask.sum()) == 120 and not mask[: t.prompt_len].any()
        assert (t.versions[~mask] == -1).all() and (t.logprobs[~mask] == 0).all()
        # what the servers answered for this sample's requests, in order (turn, segment)
        mine = [res for rid, res in ctl.client.answers if rid.startswith(t.sample_id + "-t")]
        ids = [i for res in mine for i in res.raw["output_ids"]]
        lps = [x[0] for res in mine for x in res.raw["meta_info"]["output_token_logprobs"]]
        vers = [int(res.weight_version) for res in mine for _ in res.output_ids]
        assert t.input_ids[mask].tolist() == ids
        assert np.array_equal(t.logprobs[mask], np.asarray(lps, dtype=np.float32))
        assert t.versions[mask].tolist() == vers
        if len(set(vers)) == 2:
            switched += 1
        # and they are the logprobs of the weights that produced them
        full = t.input_ids.tolist()
        ref_a = biased_logprobs(models["ma"], full)
        ref_b = biased_logprobs(models["mb"], full)
        pos = np.nonzero(mask)[0]
        ref = [(ref_a if v == 0 else ref_b)[p - 1] for p, v in zip(pos, t.versions[mask])]
        assert np.abs(np.asarray(ref) - t.logprobs[mask]).max() <= 1e-4
    assert switched >= 1 and ctl.stats()["interruptions"] >= 1


class Hold:
    """An episode that opens an HTTP session, hands (base_url, key) to the test and stays
    open until the test is done with it."""

    def __init__(self):
        self.q, self.done = queue.Queue(), threading.Event()

    async def __call__(self, ctx, item):
        url, key = await ctx.openai_endpoint()
        self.q.put((url, key))
        while not self.done.is_set():
            await asyncio.sleep(0.02)
        ctx.close_endpoint(key)
        return 0.5


def test_http_endpoint_with_official_openai_client(server, models):
    tok = AutoTokenizer.from_pretrained(models["a"])
    tok.chat_template = HERMES_TEMPLATE
    hold = Hold()

    async def episode(ctx, item):
        return await hold(ctx, item)

    sink = GroupSink()
    ctl = controller(
        server.addr,
        build_workflow(episode, {}, WorkflowSettings(max_new_tokens=16)),
        tok,
        sink,
        n_prompts=1,
        batch_size=1,
        n_samples=1,
    ).start()
    try:
        url, key = hold.q.get(timeout=60)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["areal-mega-policy"]
        r = client.chat.completions.create(
            model="policy",
            seed=3,
            logprobs=True,
            messages=[{"role": "user", "content": "2+2="}],
            max_tokens=8,
            logit_bias=NO_SPECIAL,
        )
        ch = r.choices[0]
        assert r.object == "chat.completion" and ch.message.role == "assistant"
        assert ch.finish_reason == "length" and r.usage.completion_tokens == 8
        assert len(ch.logprobs.content) == 8 and isinstance(ch.message.content, str)
        rn = client.chat.completions.create(
            model="policy",
            n=3,
            max_completion_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
        )
        assert [c.index for c in rn.choices] == [0, 1, 2]
        assert rn.usage.completion_tokens == 12
        # a tool-call round trip: the assistant's call and the tool's answer go back in
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "python",
                    "description": "run code",
                    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
                },
            }
        ]
        convo = [
            {"role": "user", "content": "1+1?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "python", "arguments": '{"code": "1+1"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        ]
        rt = client.chat.completions.create(
            model="policy", messages=convo, tools=tools, tool_choice="auto", max_tokens=4
        )
        rendered = tok.apply_chat_template(
            messages_for_template(convo), tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert '<tool_call>{"name": "python", "arguments": {"code": "1+1"}}' in rendered
        assert "<tool_response>2</tool_response>" in rendered
        assert rt.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])
        rc = client.completions.create(model="policy", prompt="abc", max_tokens=5)
        assert rc.object == "text_completion" and rc.usage.completion_tokens == 5
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}]
            )
        assert e.value.status_code == 401 and "invalid API key" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="policy", messages=[{"role": "robot", "content": "x"}]
            )
        assert e.value.status_code == 400 and "messages[0].role" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="policy", stream=True, messages=[{"role": "user", "content": "x"}]
            )
        assert e.value.body["param"] == "stream"
        with pytest.raises(openai.BadRequestError) as e:  # refused by the rollout server
            client.chat.completions.create(
                model="policy", max_tokens=100000, messages=[{"role": "user", "content": "x"}]
            )
        assert "too long" in e.value.body["message"]
        hold.done.set()
        [group] = sink.take(ctl, 1, timeout=60)
    finally:
        hold.done.set()
        ctl.stop()
    # six recorded completions, none extending another: six samples sharing the reward
    assert len(group) == 6 and all(t.reward == 0.5 for t in group)
    first = group[0]
    gen = first.logprobs[first.loss_mask.astype(bool)]
    assert np.array_equal(
        gen, np.asarray([c.logprob for c in ch.logprobs.content], dtype=np.float32)
    )
    assert len({t.sample_id for t in group}) == 6


def test_docs_example_runs(server, models, tmp_path):
    """The complete example of docs/workflows.md, loaded as `file.py:episode` with
    workflow_kwargs, trains: each sample's calls become trajectories with the episode reward."""
    from pathlib import Path

    from areal_mega.common.loading import load_object

    doc = (Path(__file__).resolve().parents[1] / "docs" / "workflows.md").read_text()
    example = doc.split("## A complete example\n", 1)[1]
    code = example.split("```python\n", 1)[1].split("```", 1)[0]
    assert 30 <= len(code.splitlines()) <= 45
    (tmp_path / "my_agent.py").write_text(code)
    tok = AutoTokenizer.from_pretrained(models["a"])
    tok.chat_template = HERMES_TEMPLATE
    wf = build_workflow(
        load_object(f"{tmp_path / 'my_agent.py'}:episode", "rollout.workflow"),
        {"max_turns": 2},
        WorkflowSettings(),
    )
    sink = GroupSink()
    ctl = controller(server.addr, wf, tok, sink, n_prompts=1, batch_size=1, n_samples=2).start()
    try:
        [group] = sink.take(ctl, 1, timeout=120)
    finally:
        ctl.stop()
    assert len(group) >= 2 and all(t.reward == 0.0 for t in group)  # an untrained model
    assert all(int(t.loss_mask.sum()) >= 1 for t in group)

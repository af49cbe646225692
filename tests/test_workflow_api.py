"""The Workflow API's pure parts: loading a workflow named by config (module or file), its
kwargs from YAML and dotlist, errors naming the bad key; the episode -> samples planner
(chained calls -> one sequence, otherwise one sample per completion); Qwen/Hermes tool-call
parsing and message normalisation; OpenAI request validation."""

import asyncio

import pytest

from areal_mega.common.loading import load_object
from areal_mega.config import ConfigError, load_config
from areal_mega.workflow.api import (
    EpisodeWorkflow,
    FunctionWorkflow,
    WorkflowSettings,
    build_workflow,
)
from areal_mega.workflow.builtin import RLVRWorkflow, workflow_from_config
from areal_mega.workflow.episode_export import chains, plan_samples
from areal_mega.workflow.openai_client import (
    CompletionRecord,
    OpenAIRequestError,
    chat_request,
    sampling_of,
)
from areal_mega.workflow.tool_calls import messages_for_template, parse_tool_calls

USER_FILE = """
from areal_mega.workflow.api import EpisodeWorkflow

async def my_episode(ctx, item, bonus=0.0):
    return 1.0 + bonus

class MyWorkflow(EpisodeWorkflow):
    def __init__(self, turns=1):
        self.turns = turns
"""


def test_workflow_from_file_module_and_config(tmp_path):
    f = tmp_path / "wf.py"
    f.write_text(USER_FILE)
    fn = load_object(f"{f}:my_episode", "rollout.workflow")
    wf = build_workflow(fn, {"bonus": 2.0}, WorkflowSettings(max_new_tokens=7))
    assert isinstance(wf, FunctionWorkflow) and wf.kwargs == {"bonus": 2.0}
    assert wf.settings.max_new_tokens == 7
    cls_wf = build_workflow(
        load_object(f"{f}:MyWorkflow", "rollout.workflow"), {"turns": 3}, WorkflowSettings()
    )
    assert isinstance(cls_wf, EpisodeWorkflow) and cls_wf.turns == 3
    # from config: YAML mapping and dotlist leaves both reach the workflow
    y = tmp_path / "c.yaml"
    y.write_text(f"rollout:\n  workflow: {f}:MyWorkflow\n  workflow_kwargs: {{turns: 2}}\n")
    cfg = load_config(y, ["rollout.workflow_kwargs.turns=5", "rollout.max_new_tokens=9"])
    assert cfg.rollout.workflow_kwargs == {"turns": 5}
    wf = workflow_from_config(cfg.rollout)
    assert wf.turns == 5 and wf.settings.max_new_tokens == 9
    built_in = workflow_from_config(load_config(None, []).rollout)
    assert isinstance(built_in, RLVRWorkflow)
    mod = load_object("areal_mega.workflow.builtin:RLVRWorkflow", "rollout.workflow")
    assert mod is RLVRWorkflow


def test_workflow_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="rollout.workflow='nonsense'"):
        load_config(None, ["rollout.workflow=nonsense"])
    with pytest.raises(ConfigError, match="rollout.workflow_kwargs"):
        load_config(None, ["rollout.workflow_kwargs=3"])
    with pytest.raises(ValueError, match="does not exist"):
        load_object(f"{tmp_path}/missing.py:x", "rollout.workflow")
    with pytest.raises(ValueError, match="cannot import"):
        load_object("no_such_pkg.mod:x", "rollout.workflow")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_object("areal_mega.workflow.builtin:nope", "rollout.workflow")
    f = tmp_path / "wf2.py"
    f.write_text(USER_FILE)
    with pytest.raises(ValueError, match="do not fit MyWorkflow"):
        build_workflow(
            load_object(f"{f}:MyWorkflow", "rollout.workflow"), {"wrong": 1}, WorkflowSettings()
        )

    def not_async(ctx, item):
        return 0.0

    with pytest.raises(ValueError, match="neither an async episode function"):
        build_workflow(not_async, {}, WorkflowSettings())


def rec(prompt, out, v=0):
    return CompletionRecord(
        list(prompt), list(out), [-0.5 - 0.01 * i for i in range(len(out))], [v] * len(out), "stop"
    )


def test_chained_calls_are_one_sequence():
    recs = [
        rec([1, 2, 3], [4, 5], v=0),
        rec([1, 2, 3, 4, 5, 9, 9], [6], v=1),
        rec([1, 2, 3, 4, 5, 9, 9, 6], [7, 8], v=1),
    ]
    assert chains(recs)
    [(seq, r, plen, idx)] = plan_samples(recs, 2.0, discount=0.5)
    assert (r, plen, idx) == (2.0, 3, [0, 1, 2])  # one sequence: no discount
    assert seq.input_ids == [1, 2, 3, 4, 5, 9, 9, 6, 7, 8]
    assert seq.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert seq.versions == [-1, -1, -1, 0, 0, -1, -1, 1, 1, 1]
    assert seq.logprobs[3:5] == recs[0].logprobs and seq.logprobs[5:7] == [0.0, 0.0]
    assert seq.logprobs[7] == recs[1].logprobs[0]


def test_unchained_calls_are_separate_samples_with_discount():
    # the second prompt re-rendered the first answer differently ([4, 0] instead of [4, 5])
    recs = [rec([1, 2], [4, 5]), rec([1, 2, 4, 0, 7], [8, 9]), rec([3], [1])]
    assert not chains(recs)
    plans = plan_samples(recs, 1.0, discount=0.5)
    assert [p[1] for p in plans] == [0.25, 0.5, 1.0]
    assert [p[2] for p in plans] == [2, 5, 1]
    for seq, _, plen, [k] in plans:
        assert seq.input_ids == recs[k].prompt_ids + recs[k].output_ids
        assert seq.loss_mask == [0] * plen + [1] * len(recs[k].output_ids)
    assert plan_samples([], 1.0) == []
    # a single call chains trivially
    assert len(plan_samples(recs[:1], 1.0)) == 1


def test_parse_tool_calls():
    text = (
        'Let me compute.<tool_call>\n{"name": "python", "arguments": {"code": "1+1"}}\n'
        '</tool_call> and <tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute. and"
    assert [c["function"]["name"] for c in calls] == ["python", "x"]
    assert calls[0]["function"]["arguments"] == '{"code": "1+1"}'
    assert calls[1]["function"]["arguments"] == '{"a": 1}'
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # malformed JSON is not a call: the text stays content
    bad = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_messages_for_template():
    msgs = messages_for_template(
        [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "python", "arguments": '{"code": "2"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ]
    )
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"code": "2"}
    for bad, where in [
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role"),
        ([{"role": "user"}], r"messages\[0\].content"),
        (["hi"], r"messages\[0\]: expected an object"),
        ([], "must not be empty"),
    ]:
        with pytest.raises(ValueError, match=where):
            messages_for_template(bad)


def test_openai_request_validation():
    n, max_new, sp, seed = sampling_of(
        {
            "n": 3,
            "max_completion_tokens": 5,
            "stop": "x",
            "temperature": 0.5,
            "seed": 7,
            "logit_bias": {"2": -100},
        },
        64,
    )
    assert (n, max_new, seed) == (3, 5, 7)
    assert sp == {"temperature": 0.5, "stop": ["x"], "logit_bias": {2: -100.0}}
    assert sampling_of({}, 64)[:2] == (1, 64)
    for body, param in [
        ({"n": 0}, "n"),
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
    ]:
        with pytest.raises(OpenAIRequestError) as e:
            sampling_of(body, 64)
        assert e.value.param == param and e.value.status == 400

    async def never(*a, **k):
        raise AssertionError("validation must fail before generating")

    for body, param in [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
        ({"messages": [], "bogus": 1}, "bogus"),
    ]:
        with pytest.raises(OpenAIRequestError) as e:
            asyncio.run(chat_request(body, never, None, [], 8))
        assert e.value.param == param
        assert e.value.body()["error"]["message"]

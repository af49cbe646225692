"""ExternalAgent against a real CPU rollout server and RolloutController: agent programs that
know only OPENAI_BASE_URL / OPENAI_API_KEY are trained episodes; one that crashes, hangs (its
whole process group is killed), prints no reward or a malformed one is counted and logged,
never fatal."""

import sys
import time
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.controller import RolloutController
from areal_mega.workflow.api import WorkflowSettings, build_workflow
from areal_mega.workflow.external_agent import ExternalAgent, parse_reward
from tests.helpers.rollout import API_KEY, GroupSink

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


def test_parse_reward():
    assert parse_reward('log\n{"reward": 0.5}\n\n') == 0.5
    assert parse_reward('{"reward": 1}') == 1.0
    for out, msg in [
        ("", "printed nothing"),
        ("done", "not JSON"),
        ('{"reward": "high"}', "no finite number"),
        ('{"reward": NaN}', "finite"),
        ("[1]", "no finite number"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_reward(out)


def test_agent_arguments_checked():
    with pytest.raises(ValueError, match="command"):
        ExternalAgent(command=" ")
    with pytest.raises(ValueError, match="timeout_s"):
        ExternalAgent(command="true", timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrent"):
        ExternalAgent(command="true", max_concurrent=0)


def test_external_agents_ok_and_failures(server, models):
    started = time.time()
    tok = AutoTokenizer.from_pretrained(models["a"])
    agent = build_workflow(
        ExternalAgent,
        {
            "command": f"{sys.executable} {ROOT / 'tests' / 'helpers' / 'modes_agent.py'}",
            "timeout_s": 12,
            "max_concurrent": 4,
        },
        WorkflowSettings(max_new_tokens=8),
    )
    modes = ["ok", "crash", "hang", "noreward", "ok", "badreward"]
    items = [{"prompt": f"abc{i}", "answer": "", "mode": m} for i, m in enumerate(modes)]
    sink = GroupSink()
    client = RolloutClient([server.addr], api_key=API_KEY, timeout_s=120, retries=2)
    ctl = RolloutController(
        client,
        agent,
        items,
        batch_size=len(items),
        n_samples=2,
        eta=0,
        sink=sink,
        tokenizer=tok,
        max_episode_retries=1,
        on_episode_failure="drop",
    ).start()
    try:
        deadline = time.monotonic() + 120
        while ctl.stats()["dropped_prompts"] + len(sink) < len(items):
            assert time.monotonic() < deadline, ctl.stats()
            ctl.raise_if_failed()
            time.sleep(0.1)
        st = ctl.stats()
    finally:
        ctl.stop()
    assert len(sink) == 2 and st["dropped_prompts"] == 4
    assert st["agent_ok"] == 4
    assert st["agent_failed/exit_code"] == 2 and st["agent_failed/timeout"] == 2
    assert st["agent_failed/no_reward"] == 4
    for group in sink.groups:
        assert len(group) == 2  # no sample lost
        for t in group:
            n_gen = int(t.loss_mask.sum())
            assert n_gen == 4 and t.prompt_len == len(t.input_ids) - 4
            assert 0.0 <= t.reward <= 1.0
    # the hanging agents' children died with their process group
    left = [
        p
        for p in psutil.process_iter(["cmdline", "create_time"])
        if p.info["cmdline"] == ["sleep", "300"] and p.info["create_time"] >= started
    ]
    assert left == []


def test_example_agent_runs(server, models):
    """examples/external_agent/agent.py through ExternalAgent: every sample is trained."""
    tok = AutoTokenizer.from_pretrained(models["a"])
    agent = build_workflow(
        ExternalAgent,
        {"command": f"{sys.executable} {ROOT / 'examples' / 'external_agent' / 'agent.py'}"},
        WorkflowSettings(),
    )
    sink = GroupSink()
    client = RolloutClient([server.addr], api_key=API_KEY, timeout_s=120, retries=2)
    items = [{"prompt": "12345=", "answer": "54321"}, {"prompt": "777=", "answer": "777"}]
    ctl = RolloutController(
        client, agent, items, batch_size=2, n_samples=3, eta=0, sink=sink, tokenizer=tok
    ).start()
    try:
        groups = sink.take(ctl, 2, timeout=120)
    finally:
        ctl.stop()
    assert [len(g) for g in groups] == [3, 3] and agent.stats() == {"agent_ok": 6}
    assert all(0.0 <= t.reward <= 1.0 and t.loss_mask.sum() >= 1 for g in groups for t in g)

"""Episodes that cannot succeed end, against a real CPU rollout server: a prompt longer than the
model's context is rejected by the server (HTTP 400) and fails at once instead of being retried
forever; ``on_episode_failure=drop`` drops and counts such prompts (and ones out of retries)
while the others are delivered, with the staleness counters exact, until the dropped share
passes the failure-rate ceiling (the controller's own prompts, or outcomes another component
records through ``record_outcome``)."""

import re
import time

import pytest

from areal_mega.inference.process import launch_local_servers
from areal_mega.models.tiny import make_tiny_model
from areal_mega.rewards import exact_match_reward
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.failures import FailureRate, FailureRateExceeded
from areal_mega.workflow.builtin import RLVRWorkflow
from tests.helpers.rollout import API_KEY, GroupSink

pytestmark = pytest.mark.timeout(300)
CONTEXT = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(
        tmp_path_factory.mktemp("ctx_model") / "m",
        arch="llama",
        hidden_size=32,
        num_layers=1,
        max_position_embeddings=CONTEXT,
    )
    (proc,) = launch_local_servers(str(model), 1, api_key=API_KEY)
    try:
        yield proc
    finally:
        proc.stop()


def short(i):
    return {"input_ids": [5 + i, 6, 7, 8], "answer": "never"}


def too_long(i):
    return {"input_ids": [9 + i] * (CONTEXT + 6), "answer": "never"}


class _FailsOnFlagged:
    """RLVR, except that prompts marked ``always_fails`` raise (a retryable failure)."""

    def __init__(self, inner):
        self.inner = inner

    async def arun_episode(self, ctx, item, n_samples):
        if item.get("always_fails"):
            raise RuntimeError("injected failure")
        return await self.inner.arun_episode(ctx, item, n_samples)


def controller(server, items, sink, **kw):
    client = RolloutClient([server.addr], api_key=API_KEY, timeout_s=120, retries=4, backoff_s=0.05)
    wf = _FailsOnFlagged(RLVRWorkflow(exact_match_reward, 4))
    return RolloutController(
        client,
        wf,
        items,
        batch_size=2,
        n_samples=2,
        eta=1,
        sink=sink,
        ignore_eos=True,
        max_episode_retries=3,
        **kw,
    )


def failure(ctl):
    """The controller's failure as raised by ``raise_if_failed``, or None."""
    try:
        ctl.raise_if_failed()
    except RuntimeError as e:
        return e
    return None


def wait_until(cond):
    """Poll ``cond`` (no deadline of its own: the module timeout bounds it)."""
    while not cond():
        time.sleep(0.02)


def test_too_long_prompt_fails_at_once_with_one_clear_error(server):
    """fail mode: the server's HTTP 400 ("request too long") ends the run after one attempt,
    not after the retry budget (or never), with the server's reason in the error."""
    sink = GroupSink()
    ctl = controller(server, [too_long(0)], sink).start()
    try:
        wait_until(lambda: failure(ctl))
        err = failure(ctl)
    finally:
        ctl.stop()
    assert "rejected the request" in str(err) and "not retried" in str(err)
    assert "request too long" in str(err) and "HTTP 400" in str(err)
    s = ctl.stats()
    assert (s["started"], s["failed"], s["dropped_prompts"], len(sink)) == (1, 1, 0, 0)


def test_retry_budget_ends_after_the_prompts_ran_out(server):
    """A prompt that always fails (retryable) is retried after the prompt source ran dry, and
    fails the run on its max_episode_retries-th attempt (the retry was never started once the
    source was exhausted: the run hung without an error)."""
    ctl = controller(server, [{**short(0), "always_fails": True}], GroupSink()).start()
    try:
        wait_until(lambda: failure(ctl))
        err = failure(ctl)
    finally:
        ctl.stop()
    assert "episode failed 3 times: injected failure" in str(err)
    assert (ctl.stats()["started"], ctl.stats()["failed"]) == (3, 3)


def test_drop_mode_counts_dropped_prompts_and_delivers_the_others(server):
    """drop mode: too-long prompts are dropped after one attempt, an always-failing one after
    max_episode_retries attempts; every other prompt is delivered, nothing fails the run, and
    the staleness counters count only delivered groups (capacity exact)."""
    items = [
        short(0),
        too_long(1),
        short(2),
        {**short(3), "always_fails": True},
        short(4),
        too_long(5),
        short(6),
    ]
    sink = GroupSink()
    ctl = controller(server, items, sink, on_episode_failure="drop").start()
    try:
        wait_until(
            lambda: (
                ctl.raise_if_failed()
                or ctl.stats()["dropped_prompts"] == 3
                and len(sink) == 4
                and ctl.stats()["running"] == 0
            )
        )
        ctl.raise_if_failed()
        s = ctl.stats()
    finally:
        ctl.stop()
    assert s["dropped_prompts"] == 3
    assert s["failed"] == 2 + 3  # too long: once each; the flagged one: 3 attempts
    assert s["accepted"] == 4 == s["finished"] and s["started"] == 4 + s["failed"]
    assert s["capacity"] == (1 + 0 + 1) * 2 - 4  # (eta + version + 1) * batch - accepted
    delivered = sorted(tuple(g[0].input_ids[: g[0].prompt_len].tolist()) for g in sink.groups)
    assert delivered == sorted(tuple(short(i)["input_ids"]) for i in (0, 2, 4, 6))


def test_a_request_the_server_cannot_sample_fails_instead_of_looping(server):
    """A finite but huge logit bias at a tiny temperature makes every row unsamplable: the
    server finishes the request with an abort carrying ``status_code`` 400 (an error, not a
    weight-update interruption), and the controller fails the episode at once instead of
    resubmitting the partial output forever."""
    sink = GroupSink()
    ctl = controller(server, [short(0)], sink, temperature=1e-5, logit_bias={"5": 1e38}).start()
    try:
        wait_until(lambda: failure(ctl))
        err = failure(ctl)
    finally:
        ctl.stop()
    assert "status 400" in str(err) and "sampling error" in str(err)
    s = ctl.stats()
    assert (s["started"], s["failed"], len(sink)) == (1, 1, 0)


def test_drop_mode_stops_once_the_dropped_share_passes_the_ceiling(server):
    """Three always-failing prompts and one good one, ceiling 0.5 checked from 3 outcomes: the
    third outcome (2 or 3 of 3 dropped, whatever the order) fails the run with one error
    naming the rate, the window and the keys; the prompts before it were dropped, not fatal."""
    items = [short(0)] + [{**short(i), "always_fails": True} for i in (1, 2, 3)]
    sink = GroupSink()
    ctl = controller(
        server,
        items,
        sink,
        on_episode_failure="drop",
        failure_rate=FailureRate(ceiling=0.5, window=8, min_prompts=3),
    ).start()
    try:
        wait_until(lambda: failure(ctl))
        err = failure(ctl)
    finally:
        ctl.stop()
    assert isinstance(err.__cause__, FailureRateExceeded)
    said = re.search(
        r"(\d) of the last 3 prompts failed \(rate (\S+) > rollout\."
        r"failure_rate_ceiling=0\.5, window rollout\.failure_window=8 prompts, "
        r"checked from rollout\.failure_min_prompts=3; by reason: "
        r"out_of_retries=(\d)\)",
        str(err),
    )
    assert said, str(err)
    failed = int(said[1])
    assert failed in (2, 3) and said[2] == f"{failed / 3:.2f}" and int(said[3]) == failed
    assert "episode failed 3 times: injected failure" in str(err)
    assert ctl.stats()["dropped_prompts"] >= failed  # the last one may end after the error


def test_outcomes_recorded_from_outside_count_and_hit_the_same_ceiling(server):
    """``record_outcome``: how a component that runs tasks outside the controller's prompts
    (the online gateway) drops and counts them; the ceiling is the same."""
    ctl = controller(
        server,
        iter(()),
        GroupSink(),
        on_episode_failure="drop",
        failure_rate=FailureRate(ceiling=0.5, window=4, min_prompts=4),
    ).start()
    try:
        for ok in (True, False, True, False):  # 2 of 4: at the ceiling, not above
            ctl.record_outcome(ok, "agent_exit", "session ended with exit code 1")
        assert failure(ctl) is None
        ctl.record_outcome(False, "agent_exit", "session ended with exit code 1")  # 3 of 4
        err = failure(ctl)
    finally:
        ctl.stop()
    assert isinstance(err.__cause__, FailureRateExceeded)
    assert "3 of the last 4 prompts failed (rate 0.75" in str(err)
    assert "by reason: agent_exit=3" in str(err) and "session ended with exit code 1" in str(err)
    s = ctl.stats()
    assert (s["dropped_prompts"], s["dropped/agent_exit"], s["failure_rate"]) == (3, 3, 0.75)

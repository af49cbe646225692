"""The failure accounting of :mod:`areal_mega.rollout.failures`: what ``on_episode_failure``
means per workflow, the retry / drop / fail decision, and the failure-rate ceiling over a
sliding window of prompt outcomes (edges: the minimum count, a rate equal to the ceiling, the
window sliding, ceilings 0 and 1, concurrent callers)."""

import threading

import pytest

from areal_mega.config import ConfigError, load_config
from areal_mega.rollout.client import RolloutRequestError
from areal_mega.rollout.failures import (
    EpisodeFailures,
    FailureRate,
    FailureRateExceeded,
    episode_failure_policy,
)

AGENT = "areal_mega.workflow.external_agent:ExternalAgent"


def outcomes(rate: FailureRate, seq: str) -> list:
    """Record ``seq`` (``o``: ok, ``x``: failed) and return the indices that tripped."""
    return [i for i, c in enumerate(seq) if rate.record(c == "o", "out_of_retries")]


@pytest.mark.parametrize(
    "setting,workflow,want",
    [
        ("auto", "rlvr", "fail"),
        ("auto", "multi_turn", "fail"),
        ("auto", AGENT, "drop"),
        ("auto", "my_agents.py:episode", "drop"),
        ("fail", AGENT, "fail"),
        ("drop", "rlvr", "drop"),
    ],
)
def test_auto_drops_for_agent_workflows_and_fails_for_the_built_in_ones(setting, workflow, want):
    assert episode_failure_policy(setting, workflow) == want


def test_the_config_default_is_auto_with_a_ceiling():
    r = load_config(None, []).rollout
    assert (
        r.on_episode_failure,
        r.failure_rate_ceiling,
        r.failure_window,
        r.failure_min_prompts,
    ) == ("auto", 0.5, 64, 16)
    with pytest.raises(ValueError, match="must be auto, fail or drop"):
        episode_failure_policy("maybe", AGENT)


def test_min_prompts_above_the_window_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"rollout\.failure_min_prompts=9: must be <= "
        r"rollout\.failure_window \(8\)",
    ):
        load_config(None, ["rollout.failure_window=8", "rollout.failure_min_prompts=9"])
    with pytest.raises(ConfigError, match="rollout.failure_rate_ceiling"):
        load_config(None, ["rollout.failure_rate_ceiling=1.5"])


def test_nothing_trips_before_min_prompts_outcomes_then_at_once():
    rate = FailureRate(ceiling=0.5, window=8, min_prompts=4)
    assert outcomes(rate, "xxx") == []  # 3 of 3 failed, but fewer than 4 known
    assert rate.rate() == 1.0
    assert outcomes(rate, "x") == [0]  # the 4th outcome


def test_a_rate_equal_to_the_ceiling_goes_on_and_an_ok_never_trips():
    rate = FailureRate(ceiling=0.5, window=4, min_prompts=4)
    assert outcomes(rate, "xoxo") == []  # 2 of 4 = 0.5: not above
    assert outcomes(rate, "xx") == [1]  # oxox, then xoxx: 3 of 4
    assert outcomes(rate, "o") == []  # oxxo: 0.5 again
    assert outcomes(rate, "xx") == [0, 1]  # xxox, xoxx: above, each failure says so
    assert outcomes(rate, "o") == [] and rate.rate() == 0.5  # an ok never trips


def test_old_failures_leave_the_window():
    rate = FailureRate(ceiling=0.5, window=4, min_prompts=2)
    assert outcomes(rate, "oo") == []
    assert outcomes(rate, "xx") == []  # oo xx: 0.5
    assert outcomes(rate, "oo") == []  # xx oo
    assert rate.rate() == 0.5
    assert outcomes(rate, "oo") == [] and rate.rate() == 0.0  # the failures slid out
    assert outcomes(rate, "xxx") == [2]  # ooox, ooxx (0.5), oxxx: 3 of 4


def test_ceiling_one_never_stops_and_ceiling_zero_stops_on_any_failure():
    never = FailureRate(ceiling=1.0, window=4, min_prompts=1)
    assert outcomes(never, "x" * 20) == []
    strict = FailureRate(ceiling=0.0, window=4, min_prompts=3)
    assert outcomes(strict, "oox") == [2]


@pytest.mark.parametrize(
    "kw", [{"ceiling": -0.1}, {"ceiling": 1.1}, {"window": 4, "min_prompts": 5}, {"min_prompts": 0}]
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        FailureRate(**kw)


def test_the_error_is_one_line_naming_the_rate_the_window_the_keys_and_the_reasons():
    rate = FailureRate(ceiling=0.5, window=10, min_prompts=3)
    for ok, reason in [(False, "rejected"), (True, ""), (False, "out_of_retries")]:
        err = rate.record(ok, reason, "episode failed 3 times: exited with 1")
    assert isinstance(err, FailureRateExceeded)
    msg = str(err)
    assert "\n" not in msg
    assert "2 of the last 3 prompts failed (rate 0.67 > rollout.failure_rate_ceiling=0.5" in msg
    assert "rollout.failure_window=10 prompts" in msg and "rollout.failure_min_prompts=3" in msg
    assert "by reason: out_of_retries=1, rejected=1" in msg
    assert "the last: episode failed 3 times: exited with 1" in msg


def test_retry_then_drop_counts_by_reason():
    f = EpisodeFailures("drop", max_retries=3, rate=FailureRate(1.0, 8, 1))
    boom = RuntimeError("exited with 1")
    assert f.after_failure(0, boom) == (True, None)
    assert f.after_failure(1, boom) == (True, None)
    assert f.after_failure(2, boom) == (False, None)  # out of retries: dropped
    assert f.after_failure(0, RolloutRequestError("too long", status=400)) == (False, None)
    assert f.after_failure(0, RolloutRequestError("busy", status=429)) == (True, None)
    assert f.stats() == {
        "dropped_prompts": 2,
        "retries": 3,
        "dropped/out_of_retries": 1,
        "dropped/rejected": 1,
        "failure_rate": 1.0,
    }


def test_fail_policy_returns_the_episode_error_and_drops_nothing():
    f = EpisodeFailures("fail", max_retries=1)
    cause = RuntimeError("every sample failed")
    retry, err = f.after_failure(0, cause)
    assert not retry and str(err) == "episode failed 1 times: every sample failed"
    assert err.__cause__ is cause and not isinstance(err, FailureRateExceeded)
    err = f.record_outcome(False, "agent_exit", "exited with 1")  # a task run elsewhere
    assert str(err) == "task failed (agent_exit): exited with 1"
    assert not isinstance(err, FailureRateExceeded) and f.record_outcome(True) is None
    assert f.stats()["dropped_prompts"] == 0 and f.rate.rate() == 0.0


def test_drop_policy_stops_at_the_ceiling_with_delivered_prompts_counted():
    f = EpisodeFailures("drop", max_retries=1, rate=FailureRate(0.5, 4, 4))
    f.record_outcome(True)
    errs = [f.after_failure(0, RuntimeError("exited with 1"))[1] for _ in range(3)]
    assert errs[:2] == [None, None]  # 1 of 2, 2 of 3: below min_prompts
    assert isinstance(errs[2], FailureRateExceeded)  # 3 of 4 = 0.75
    assert "rate 0.75" in str(errs[2]) and "exited with 1" in str(errs[2])


def test_concurrent_outcomes_are_all_counted():
    """The gateway may record outcomes from its own threads while the controller records."""
    f = EpisodeFailures("drop", rate=FailureRate(1.0, 10_000, 1))

    def work(ok):
        for _ in range(500):
            f.record_outcome(ok, "session_failed")

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = f.stats()
    assert s["dropped_prompts"] == s["dropped/session_failed"] == 2000
    assert s["failure_rate"] == 0.5

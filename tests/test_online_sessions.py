"""The online gateway's session book (pure): groups of one task fill the oldest slot up to
n_samples, no slot means Busy (429), the open-session cap 503, timeouts drop sessions by
reason, a group trains with its done sessions when full or timed out, an all-dropped group
gives its slot back, and rewards are checked and refused once trained."""

import math

import pytest

from areal_mega.workflow.online_sessions import (
    DONE,
    DROPPED,
    Busy,
    SessionBook,
    SessionError,
    check_reward,
)


class Calls:
    """A session's recorded completion ids (what the gateway's records hold)."""

    def __init__(self, *ids):
        self.ids = list(ids)


def book(**kw):
    args = dict(n_samples=2, session_timeout_s=10, reward_timeout_s=5)
    args.update(kw)
    return SessionBook(completion_ids=lambda s: s.data.ids if s.data else [], **args)


def started(b, sid, task, now=0.0, calls=("c-0",)):
    s = b.start(sid, task, now)
    s.data = Calls(*calls)
    return s


def test_groups_fill_slots_in_order_and_busy_without_one():
    b = book()
    with pytest.raises(Busy) as e:
        b.start("a", "t1", 0.0)
    assert e.value.status == 429 and "staleness bound" in str(e.value)
    b.add_slot(0)
    b.add_slot(1)
    a, a2 = started(b, "a", "t1"), started(b, "a2", "t1")
    c = started(b, "c", "t2")
    assert (a.slot, a2.slot, c.slot) == (0, 0, 1) and (a.index, a2.index) == (0, 1)
    assert b.groups[0].closed and not b.groups[1].closed
    with pytest.raises(Busy):  # t1's group is full and no slot is left
        b.start("a3", "t1", 0.0)
    started(b, "c2", "t2")  # t2 still joins its own group
    for bad in (None, "", 7, "x" * 300):
        with pytest.raises(SessionError, match="task_id"):
            b.start("z", bad, 0.0)


def test_open_session_cap_is_503():
    b = book(max_open_sessions=2, n_samples=8)
    b.add_slot(0)
    started(b, "a", "t")
    started(b, "b", "t")
    with pytest.raises(Busy) as e:
        b.start("c", "t", 0.0)
    assert e.value.status == 503 and "max_open_sessions" in str(e.value)


def test_done_group_is_ready_then_trained_and_late_rewards_refused():
    b = book()
    b.add_slot(0)
    a, c = started(b, "a", "t"), started(b, "c", "t", calls=("r1-0", "r1-1", "r2-0"))
    b.end(a, 1.0)
    b.set_reward(a, 1.0, now=2.0)  # a reward after the end
    assert a.state == DONE and b.tick(2.0) == ([], [])  # c still open
    b.set_reward(c, 0.5, completion_id="r1")  # a response id: both its choices
    assert c.completion_rewards == {"r1-0": 0.5, "r1-1": 0.5} and not b.has_reward(c)
    b.set_reward(c, 0.0, completion_id="r2-0")
    with pytest.raises(SessionError) as e:
        b.set_reward(c, 0.0, completion_id="nope")
    assert e.value.status == 404 and e.value.param == "completion_id"
    b.end(c, 3.0)
    dropped, [g] = b.tick(3.0)
    assert dropped == [] and [s.session_id for s in g.sessions] == ["a", "c"]
    b.set_reward(a, 0.25)  # before delivery: still taken
    b.trained(g)
    with pytest.raises(SessionError) as e:
        b.set_reward(b.get("a"), 1.0)
    assert e.value.status == 409 and "already trained" in str(e.value)
    assert b.groups == {} and b.free_slots == []


def test_timeouts_drop_by_reason_and_empty_groups_give_their_slot_back():
    b = book(n_samples=3)
    b.add_slot(0)
    b.add_slot(1)
    _idle, busy = started(b, "idle", "t"), started(b, "busy", "t")
    quiet = started(b, "quiet", "u")
    busy.inflight = 1  # a completion in flight is not idleness
    b.end(quiet, 1.0)  # ended, the reward never comes
    dropped, ready = b.tick(11.0)
    assert {(s.session_id, s.reason) for s in dropped} == {("idle", "idle"), ("quiet", "no_reward")}
    assert ready == [] and b.dropped == {"idle": 1, "no_reward": 1}
    assert b.free_slots == [1]  # u's group: everyone dropped, slot back
    with pytest.raises(SessionError) as e:
        b.get("idle")
    assert e.value.status == 410 and "idle" in str(e.value)
    with pytest.raises(SessionError) as e:
        b.end(busy, 12.0)  # an answer is still being generated
    assert e.value.status == 409
    busy.inflight = 0
    b.end(busy, 12.0)
    b.set_reward(busy, -1.0)
    # t's group waits for a third session; a later session of t joins it
    late = started(b, "late", "t", now=12.0)
    assert late.slot == 0
    nothing = started(b, "nothing", "v", now=12.0, calls=())
    b.end(nothing, 12.0)  # ended without one completion
    assert nothing.state == DROPPED and nothing.reason == "no_completions"
    b.end(late, 13.0)
    b.set_reward(late, 1.0)
    _, [g] = b.tick(13.0)
    assert [s.state for s in g.sessions] == [DROPPED, DONE, DONE]
    assert b.free_slots == [1]  # v's empty group gave slot 1 back


def test_group_timeout_trains_what_it_has():
    b = book(n_samples=4, group_timeout_s=30)
    b.add_slot(0)
    a = started(b, "a", "t")
    b.end(a, 1.0)
    b.set_reward(a, 1.0)
    assert b.tick(29.0) == ([], [])
    _, [g] = b.tick(30.0)
    assert len(g.sessions) == 1
    b.add_slot(1)
    assert started(b, "b", "t", now=31.0).slot == 1  # a new group of the same task


def test_remove_slot_drops_live_sessions():
    b = book()
    b.add_slot(0)
    b.add_slot(1)
    started(b, "a", "t")
    assert [s.session_id for s in b.remove_slot(0)] == ["a"] and b.remove_slot(1) == []
    assert b.dropped == {"shutdown": 1} and b.free_slots == []


def test_check_reward():
    assert check_reward(3, 10) == 3.0
    for bad, status in (
        (math.nan, 422),
        (math.inf, 422),
        (-math.inf, 422),
        (11, 422),
        ("1", 400),
        (True, 400),
        (None, 400),
    ):
        with pytest.raises(SessionError) as e:
            check_reward(bad, 10)
        assert e.value.status == status and e.value.param == "reward"


def test_journal_restores_done_sessions_and_counts_open_ones_once(tmp_path):
    from areal_mega.dataplane import Trajectory
    from areal_mega.workflow.online_journal import OnlineJournal

    def traj(sid, session, k, reward):
        return Trajectory.from_tokens(
            [1, 2],
            [3],
            [-0.5],
            [0],
            reward=reward,
            sample_id=sid,
            meta={"session_id": session, "prompt_index": k},
        )

    j = OnlineJournal(tmp_path / "online", fresh=True)
    for sess, k in (("s1", 4), ("s2", 4), ("s3", 5), ("s4", 5)):
        j.started(sess, k)
    j.done([traj("x-s0", "s1", 4, 0.0)])
    j.done([traj("x-s0", "s1", 4, 1.0)])  # a changed reward: the last record wins
    j.dropped("s4", "idle")
    j.close()
    with open(tmp_path / "online" / "events.jsonl", "a") as f:
        f.write('{"start": "s5", "pro')  # a line cut short by the kill
    j = OnlineJournal(tmp_path / "online", fresh=False)
    assert sorted(j.left_open) == ["s2", "s3"]
    [t] = j.restore(4)
    assert (t.sample_id, t.reward, t.meta["session_id"]) == ("x-s0", 1.0, "s1")
    assert j.restore(4) == [] and j.restore(5) == []
    j.close()
    j = OnlineJournal(tmp_path / "online", fresh=False)
    assert j.left_open == []  # counted by the first restart only
    j.close()
    assert OnlineJournal(tmp_path / "online", fresh=True).restore(4) == []

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


def test_journal_retires_the_sessions_the_trainer_accepted(tmp_path):
    """4,000 done sessions (2,000 prompt positions), the trainer's ledger holding all but the
    last 10 positions, one session ended and awaiting its reward, 100 dropped: a restart that
    retires the accepted ones holds (memory) and keeps (disk) only the pending sessions, and
    a second restart finds them again."""
    import shutil
    import tracemalloc

    from areal_mega.dataplane import Trajectory
    from areal_mega.workflow.online_journal import OnlineJournal

    def traj(session, k):
        return Trajectory.from_tokens(
            list(range(64)),
            list(range(192)),
            [-0.5] * 192,
            [1] * 192,
            reward=1.0,
            sample_id=f"run-g{k}-{session}",
            meta={"session_id": session, "prompt_index": k},
        )

    d = tmp_path / "online"
    j = OnlineJournal(d, fresh=True)
    for i in range(0, 4000, 50):  # 50 sessions a write: one fsync each, not 4,000
        for n in range(i, i + 50):
            j.started(f"s{n}", n // 2)
        j.done([traj(f"s{n}", n // 2) for n in range(i, i + 50)])
    for i in range(100):
        j.started(f"x{i}", 1999)
        j.dropped(f"x{i}", "idle")
    j.started("waiting", 1999)
    j.ended({"session_id": "waiting", "prompt_index": 1999})
    j.close()
    shutil.copytree(d, tmp_path / "before")
    accepted = set(range(1990))  # the trainer's accepted-prompt ledger

    def held(restart):
        """``(journal, result, bytes)``: the memory a restarted journal holds."""
        tracemalloc.start()
        try:
            jj, out = restart()
            return jj, out, tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    def read_all():  # as a restart did before: every session of the run in memory
        jj = OnlineJournal(tmp_path / "before", fresh=False)
        return jj, jj.restore(None)

    def retiring():
        jj = OnlineJournal(d, fresh=False)
        return jj, jj.retire(accepted)

    old, _, mem_all = held(read_all)
    assert sum(len(v) for v in old.by_prompt.values()) == 4000
    old.close()
    j, info, mem_after = held(retiring)
    assert [r["session_id"] for r in j.awaiting] == ["waiting"] and j.left_open == []
    assert sorted(j.by_prompt) == list(range(1990, 2000))
    assert info["sessions_kept"] == 21 and info["positions_kept"] == 10
    assert info["bytes_after"] * 50 < info["bytes_before"], info
    assert mem_after * 20 < mem_all, (mem_after, mem_all)
    print(
        f"4000 sessions: journal {info['bytes_before']} -> {info['bytes_after']} bytes; "
        f"memory held after a restart {mem_all} -> {mem_after} bytes"
    )
    assert not (tmp_path / "online.new").exists() and not (tmp_path / "online.old").exists()
    assert {p.stat().st_mode & 0o777 for p in d.rglob("*") if p.is_file()} == {0o600}
    assert d.stat().st_mode & 0o777 == 0o700
    j.dropped("late", "idle")  # the compacted journal is appended to again
    j.close()
    # the next restart: the pending sessions only, the drops still known (a clear 410)
    j = OnlineJournal(d, fresh=False)
    assert [r["session_id"] for r in j.awaiting] == ["waiting"] and j.left_open == []
    assert set(j.dropped_before) == {f"x{i}" for i in range(100)} | {"late"}
    got = j.restore(1995)
    assert sorted(t.meta["session_id"] for t in got) == ["s3990", "s3991"]
    assert j.restore(5) == []  # retired: trained already
    j.close()


def test_a_compaction_cut_short_leaves_a_whole_journal(tmp_path):
    """A kill while the compacted copy is built leaves the old journal; a kill between the two
    renames of the swap finishes the swap on the next start."""
    import shutil

    from areal_mega.dataplane import Trajectory
    from areal_mega.workflow.online_journal import COMPLETE, OnlineJournal

    d = tmp_path / "online"
    j = OnlineJournal(d, fresh=True)
    for i, k in enumerate((1, 1, 2, 2)):
        j.done(
            [
                Trajectory.from_tokens(
                    [1],
                    [2],
                    [-0.1],
                    [0],
                    reward=1.0,
                    sample_id=f"g{k}-{i}",
                    meta={"session_id": f"s{i}", "prompt_index": k},
                )
            ]
        )
    j.close()
    shutil.copytree(d, tmp_path / "online.new")  # a copy still being built
    j = OnlineJournal(d, fresh=False)
    assert not (tmp_path / "online.new").exists() and len(j.restore(1)) == 2
    j.close()
    j = OnlineJournal(d, fresh=False)
    j.retire({1})
    j.close()
    shutil.copytree(d, tmp_path / "online.new")  # whole, then killed after the
    (tmp_path / "online.new" / COMPLETE).write_text("")  # first rename of the swap
    d.rename(tmp_path / "online.old")
    j = OnlineJournal(d, fresh=False)
    assert not (tmp_path / "online.old").exists() and not (tmp_path / "online.new").exists()
    assert j.restore(1) == [] and len(j.restore(2)) == 2
    j.close()


def test_a_serving_journal_retires_the_segments_a_checkpoint_covers(tmp_path):
    """While serving, a checkpoint's accepted prompts retire the journal segments whose every
    session is of such a prompt; a segment holding a session of another prompt stays."""
    from areal_mega.dataplane import Trajectory
    from areal_mega.workflow.online_journal import OnlineJournal

    def traj(session, k):
        return Trajectory.from_tokens(
            [1, 2],
            [3],
            [-0.5],
            [0],
            reward=1.0,
            sample_id=f"g{k}-{session}",
            meta={"session_id": session, "prompt_index": k},
        )

    d = tmp_path / "online"
    j = OnlineJournal(d, fresh=True)
    j.done([traj("s0", 0)])
    j.done([traj("s1", 1)])
    assert j.retire_segments({5}) == []  # nothing covered: no new segment
    assert j.retire_segments({0, 1}) == [1]  # segment 1 held prompts 0 and 1
    j.done([traj("s2", 2)])
    j.done([traj("s3", 3)])
    assert j.retire_segments({0, 1, 2}) == []  # segment 2 also holds prompt 3
    assert [p.name for p in (d / "trajs").glob("*.journal")] == ["00000002.journal"]
    j.close()
    j = OnlineJournal(d, fresh=False)  # a restart finds 2 and 3
    assert [t.meta["session_id"] for t in j.restore(3)] == ["s3"]
    assert [t.meta["session_id"] for t in j.restore(2)] == ["s2"] and j.restore(0) == []
    j.close()

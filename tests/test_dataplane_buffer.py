"""TrajectoryBuffer: dedup, oldest-first complete groups, staleness, capacity, save/restore."""

import os
import threading
import time

import pytest

from areal_mega.dataplane import (
    BufferFileError,
    TrajectoryBuffer,
    TrajectoryReceiver,
    TrajectorySender,
)
from tests.helpers.trajectories import make_traj


def grouped(group, k, created, version=0):
    t = make_traj(7, group * 10 + k)
    t.group_id, t.sample_id, t.created_at = f"g{group}", f"g{group}-{k}", float(created)
    t.versions[t.versions >= 0] = version
    return t


def test_dedup_groups_and_arrival_order():
    buf = TrajectoryBuffer(group_size=2)
    # g0 arrives first but completes last (t=9); g1 completes at t=5; g2 stays incomplete.
    # Groups go out in arrival order (the rollout side delivers in start order), not by
    # completion time.
    for t in [
        grouped(0, 0, 1),
        grouped(1, 0, 2),
        grouped(1, 1, 5),
        grouped(0, 1, 9),
        grouped(2, 0, 0),
    ]:
        assert buf.put(t)
    assert not buf.put(grouped(1, 1, 5))  # duplicate sample_id
    assert buf.duplicates == 1 and len(buf) == 5 and buf.n_complete_groups == 2
    groups = buf.get_groups(2, timeout=0)
    assert [[t.sample_id for t in g] for g in groups] == [["g0-0", "g0-1"], ["g1-0", "g1-1"]]
    assert buf.get_groups(1, timeout=0.05) == []  # g2 is incomplete: nothing taken
    assert not buf.put(grouped(0, 0, 1))  # consumed ids are remembered too
    assert buf.stats()["pending_samples"] == 1 and buf.stats()["incomplete_groups"] == 1


def test_get_groups_waits_for_a_producer_and_partial():
    buf = TrajectoryBuffer(group_size=2)
    buf.put(grouped(0, 0, 1))
    th = threading.Timer(0.1, lambda: buf.put(grouped(0, 1, 2)))
    th.start()
    got = buf.get_groups(1, timeout=10)
    th.join()
    assert [t.sample_id for t in got[0]] == ["g0-0", "g0-1"]
    buf.put_many([grouped(3, 0, 1), grouped(3, 1, 1)])
    assert len(buf.get_groups(5, timeout=0.01, allow_partial=True)) == 1


def test_versions_filter_and_drop_stale():
    buf = TrajectoryBuffer(group_size=1)
    buf.put_many([grouped(0, 0, 1, version=1), grouped(1, 0, 2, version=3)])
    assert buf.stats()["min_version"] == 1 and buf.stats()["max_version"] == 3
    assert [g[0].sample_id for g in buf.get_groups(1, timeout=0, min_version=2)] == ["g1-0"]
    assert buf.drop_stale(2) == ["g0-0"] and len(buf) == 0 and buf.dropped_stale == 1


def test_capacity_blocks_new_groups_but_admits_open_ones():
    buf = TrajectoryBuffer(group_size=2, max_pending=1)
    buf.put(grouped(0, 0, 1))
    with pytest.raises(TimeoutError, match="buffer full"):
        buf.put(grouped(1, 0, 1), timeout=0.05)
    assert buf.put(grouped(0, 1, 2), timeout=0.05)  # completes g0: no deadlock
    assert len(buf.get_groups(1, timeout=0)) == 1
    assert buf.put(grouped(1, 0, 1), timeout=0.05)


def test_save_restore_roundtrip_and_atomicity(tmp_path):
    buf = TrajectoryBuffer(group_size=3)
    src = [grouped(g, k, g * 3 + k) for g in range(4) for k in range(3 if g < 3 else 1)]
    buf.put_many(src)
    buf.get_groups(1, timeout=0)  # g0 consumed before the checkpoint
    path = str(tmp_path / "buf.bin")
    buf.save(path)
    assert os.listdir(tmp_path) == ["buf.bin"]  # no temp file left behind
    back = TrajectoryBuffer.load(path)
    before = buf.pending()
    after = back.pending()
    assert [t.sample_id for t in after] == [t.sample_id for t in before]
    assert all(a.equals(b) for a, b in zip(after, before))
    assert back.stats() == buf.stats()
    assert not back.put(grouped(0, 0, 0))  # consumed-id window survived the restart
    assert [[t.sample_id for t in g] for g in back.get_groups(2, timeout=0)] == [
        [t.sample_id for t in g] for g in buf.get_groups(2, timeout=0)
    ]
    # a failed save (meta not encodable) leaves the previous file intact
    bad = grouped(9, 0, 0)
    bad.meta["x"] = object()
    buf.put(bad)
    with pytest.raises(TypeError):
        buf.save(path)
    assert os.listdir(tmp_path) == ["buf.bin"]
    assert len(TrajectoryBuffer.load(path)) == 7  # the last good save
    # corruption and truncation are detected
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-40])
    with pytest.raises(BufferFileError, match="checksum"):
        TrajectoryBuffer.load(path)
    open(path, "wb").write(b"not a buffer")
    with pytest.raises(BufferFileError, match="magic"):
        TrajectoryBuffer.load(path)


def test_pump_from_receiver_into_buffer():
    buf = TrajectoryBuffer(group_size=4)
    with TrajectoryReceiver("tcp://127.0.0.1:*") as rx:
        th, stop = buf.start_pump(rx)
        try:
            with TrajectorySender(rx.endpoint) as tx:
                for i in range(8):  # make_traj groups by i // 4
                    tx.send(make_traj(3, i))
                tx.send(make_traj(3, 0))  # a retried send is deduplicated
                assert tx.flush(timeout=10)
            groups = buf.get_groups(2, timeout=10)
            # the ack that ended flush() is sent on receipt: the retried send may still be on
            # its way from the receiver to the buffer when both groups are complete
            deadline = time.monotonic() + 10
            while buf.duplicates < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            th.join(5)
    assert [[t.sample_id for t in g] for g in groups] == [
        [f"w3-{i}" for i in range(4)],
        [f"w3-{i}" for i in range(4, 8)],
    ]
    assert buf.duplicates == 1

"""The intake's write-ahead journal checks what it replays: a journal written by the real
TrajectoryIntake (trajectories sent over a real socket) is corrupted on disk, and no corrupt
record replays, is counted as accepted or reaches the next buffer checkpoint; a torn tail still
ends a segment quietly; a segment of the old unchecksummed format is refused by name."""

import logging
import struct
import time

import msgpack
import numpy as np
import pytest

from areal_mega.config import load_config
from areal_mega.dataplane.buffer import TrajectoryBuffer
from areal_mega.dataplane.journal import HEADER_BYTES, JournalError, ReplayStats, TrajectoryJournal
from areal_mega.dataplane.transport import TrajectorySender
from areal_mega.dataplane.wire import encode_record
from areal_mega.run_dir import RunDir
from areal_mega.train.intake import TrajectoryIntake
from tests.helpers.trajectories import make_traj

pytestmark = pytest.mark.timeout(600)
N = 5


def _wait_for(cond, timeout=120):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _write_through_intake(run_dir, trajs):
    """Send ``trajs`` to a production TrajectoryIntake over an ipc socket; returns the
    journal segment it wrote."""
    intake = TrajectoryIntake(f"ipc://{run_dir}/t.sock", run_dir, group_size=1).start()
    try:
        with TrajectorySender(intake.receiver.endpoint) as s:
            for t in trajs:
                s.send(t, timeout=60)
            assert s.flush(timeout=60)
        _wait_for(lambda: intake.n_accepted == len(trajs))
    finally:
        intake.close()
    segs = sorted((run_dir / "journal").glob("*.journal"))
    assert len(segs) == 1
    return segs[0]


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    """(run dir, segment bytes, original trajectories, [(start, end) of each record])."""
    run_dir = tmp_path_factory.mktemp("journal_run")
    trajs = [make_traj(1, i, max_len=24) for i in range(1, N + 1)]
    data = _write_through_intake(run_dir, trajs).read_bytes()
    bounds, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos + 4)
        bounds.append((pos, pos + HEADER_BYTES + n))
        pos += HEADER_BYTES + n
    assert len(bounds) == N
    return run_dir, data, trajs, bounds


def _replay(path):
    stats = ReplayStats()
    return [encode_record(t) for t in TrajectoryJournal.replay(path, stats)], stats


@pytest.mark.parametrize("which", [2, N - 1])
def test_every_single_bit_flip_of_a_record_is_skipped_and_counted(journal, tmp_path, which, caplog):
    """Flip each bit of one record (a middle one, and the last one so that a corrupt header is
    not mistaken for a torn tail) in turn: the other records replay unchanged, the flipped one
    never does (it is counted, and the warning names the segment and record)."""
    _, data, trajs, bounds = journal
    want = [encode_record(t) for t in trajs]
    start, end = bounds[which]
    seg = tmp_path / "00000001.journal"
    buf = bytearray(data)
    caplog.set_level(logging.WARNING, logger="areal_mega.dataplane.journal")
    for bit in range((end - start) * 8):
        i = start + bit // 8
        buf[i] ^= 1 << (bit % 8)
        seg.write_bytes(buf)
        buf[i] ^= 1 << (bit % 8)
        caplog.clear()
        got, stats = _replay(tmp_path)
        assert got == want[:which] + want[which + 1 :], f"bit {bit} of record {which}"
        assert (stats.corrupt, stats.torn, stats.records) == (1, 0, N - 1), f"bit {bit}"
        assert f"{seg}: record {which} " in caplog.text, caplog.text


def test_reward_edited_to_1e30_is_skipped_counted_and_not_checkpointed(journal, tmp_path):
    """The edit of the issue: one record's reward set to 1e30 on disk. Recovery skips it and
    counts it (``journal/corrupt_records``), RunDir.accepted_samples does not count it, and
    the buffer checkpoint taken next does not contain it."""
    _, data, trajs, bounds = journal
    k = 1
    assert np.ndim(trajs[k].reward) == 0
    start, end = bounds[k]
    old = np.float32(trajs[k].reward).tobytes()
    assert data[start:end].count(old) == 1
    at = data.index(old, start)
    run_dir = tmp_path / "run"
    (run_dir / "journal").mkdir(parents=True)
    (run_dir / "journal" / "00000001.journal").write_bytes(
        data[:at] + np.float32(1e30).tobytes() + data[at + 4 :]
    )
    cfg = load_config(None, [f"logging.run_dir={run_dir}"])
    assert RunDir.from_config(cfg).accepted_samples(None) == N - 1
    intake = TrajectoryIntake(f"ipc://{run_dir}/t.sock", run_dir, group_size=1)
    try:
        assert intake.restore(None, step=0) == N - 1
        assert intake.n_accepted == N - 1
        assert intake.stats()["journal/corrupt_records"] == 1.0
        intake.snapshot(str(tmp_path / "buffer.bin"))
    finally:
        intake.close()
    saved = TrajectoryBuffer.load(str(tmp_path / "buffer.bin")).pending()
    assert sorted(t.sample_id for t in saved) == sorted(
        t.sample_id for i, t in enumerate(trajs) if i != k
    )
    assert all(np.all(np.abs(t.reward) < 1e6) for t in saved)


@pytest.mark.parametrize("cut", ["in_header", "in_payload", "zero_filled"])
def test_torn_tail_ends_the_segment_quietly(journal, tmp_path, cut, caplog):
    """A crash mid-append: the last record is cut inside its header or payload, or the file
    system left zero bytes where it was to go. The earlier records replay, nothing is counted
    corrupt, no warning."""
    _, data, trajs, bounds = journal
    start, end = bounds[-1]
    torn = {
        "in_header": data[: start + HEADER_BYTES // 2],
        "in_payload": data[: end - 3],
        "zero_filled": data[:start] + bytes(end - start),
    }[cut]
    (tmp_path / "00000001.journal").write_bytes(torn)
    caplog.set_level(logging.INFO, logger="areal_mega.dataplane.journal")
    got, stats = _replay(tmp_path)
    assert got == [encode_record(t) for t in trajs[:-1]]
    assert (stats.corrupt, stats.torn) == (0, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_segment_of_the_unchecksummed_format_is_refused_by_name(journal, tmp_path):
    """A segment written before records were framed (bare msgpack records) cannot be checked:
    replay refuses it with an error naming the file instead of trusting it."""
    _, _, trajs, _ = journal
    packer = msgpack.Packer(use_bin_type=True)
    seg = tmp_path / "00000003.journal"
    seg.write_bytes(b"".join(encode_record(t, packer) for t in trajs))
    with pytest.raises(JournalError, match=str(seg)):
        list(TrajectoryJournal.replay(tmp_path))


def test_segments_replay_in_order_across_rotation(tmp_path):
    """Appends before and after a rotation replay in order, each checked (no corruption)."""
    j = TrajectoryJournal(tmp_path)
    a, b = [make_traj(2, i, max_len=24) for i in range(3)], [make_traj(3, 0, max_len=24)]
    j.append(a)
    assert j.rotate() == 2 == j.current
    j.append(b)
    j.close()
    got, stats = _replay(tmp_path)
    assert got == [encode_record(t) for t in a + b]
    assert (stats.segments, stats.records, stats.corrupt, stats.torn) == (2, 4, 0, 0)

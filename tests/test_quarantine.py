"""Quarantine of samples the trainer died on: the crash records a dying trainer writes, the
count over relaunches, and the entry screen dropping (and writing out) quarantined samples."""

import json

import numpy as np

from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.train.quarantine import Quarantine, record_crash
from areal_mega.train.screen import screen_samples


def _traj(sid):
    n = 5
    mask = np.array([0, 1, 1, 1, 1], np.int8)
    return Trajectory(
        input_ids=np.arange(n) + 3,
        loss_mask=mask,
        logprobs=-np.ones(n, np.float32) * mask,
        versions=np.where(mask > 0, 0, -1).astype(np.int32),
        reward=1.0,
        sample_id=sid,
        group_id="g",
        prompt_len=1,
    )


def _die(run_dir, ids, rank=0):
    err = IndexError("index out of range in self")
    err.sample_ids = ids
    assert record_crash(run_dir, rank, err)


def test_a_micro_batch_that_kills_the_trainer_twice_is_quarantined(tmp_path):
    assert not record_crash(tmp_path, 0, RuntimeError("no samples named"))  # nothing known
    _die(tmp_path, ["a", "b"])  # first death: a suspect, still trained
    q = Quarantine(tmp_path)
    assert q.load() == 0 and "a" not in q
    assert not list((tmp_path / "quarantine").glob("crash.*"))  # counted once only
    _die(tmp_path, ["b", "a"])  # the relaunch died on it again
    q = Quarantine(tmp_path)
    assert q.load() == 2 and "a" in q and "b" in q and "c" not in q
    assert "IndexError: index out of range" in q.reason("a")
    assert q.stats() == {"quarantine/samples": 2.0}

    q = Quarantine(tmp_path)  # the next relaunch: still quarantined
    assert q.load() == 0 and "a" in q
    kept, stats, dropped = screen_samples([_traj("a"), _traj("c"), _traj("b")], quarantine=q)
    assert [t.sample_id for t in kept] == ["c"] and [t.sample_id for t in dropped] == ["a", "b"]
    assert stats == {"refused/quarantine": 2.0, "refused/samples": 2.0}
    screen_samples([_traj("a")], quarantine=q)  # written once
    lines = [json.loads(x) for x in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [x["sample_id"] for x in lines] == ["a", "b"]
    assert lines[0]["trajectory"]["input_ids"] == [3, 4, 5, 6, 7]
    assert "IndexError" in lines[0]["error"]


def test_deaths_on_different_micro_batches_quarantine_nothing(tmp_path):
    _die(tmp_path, ["a", "b"])
    Quarantine(tmp_path).load()
    _die(tmp_path, ["c", "d"], rank=1)
    q = Quarantine(tmp_path)
    assert q.load() == 0 and not q.quarantined

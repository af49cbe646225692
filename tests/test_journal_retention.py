"""Journal segments outlive the newest checkpoint while an older kept one may still be resumed
from: the pure retention plan, and the real intake on real files (a checkpoint sequence, then a
resume from the older checkpoint replays exactly the samples accepted since it)."""

import json

import pytest

from areal_mega.dataplane.journal import TrajectoryJournal, segments_to_retire
from areal_mega.run_dir import META_NAME, RunDir, iter_dir_name
from areal_mega.train.intake import TrajectoryIntake
from tests.helpers.trajectories import make_traj


@pytest.mark.parametrize(
    "segments, kept_from, retired",
    [
        ([1, 2, 3, 4], [3, 4], [1, 2]),  # the older kept checkpoint needs 3 on
        ([1, 2, 3, 4], [4, 3], [1, 2]),  # order of the checkpoints does not matter
        ([1, 2, 3], [3], [1, 2]),  # keep_last=1: only the newest's segments
        ([5, 6], [2, 6], []),  # needed segments already gone: nothing more
        ([1, 2, 3], [], []),  # no checkpoint kept (all pruned or corrupt)
        ([1, 2, 3], [None, 3], []),  # a checkpoint from before journal_from: keep all
        ([], [2], []),
        ([2, 7, 3], [7], [2, 3]),  # unsorted input, sorted answer
    ],
)
def test_segments_to_retire(segments, kept_from, retired):
    assert segments_to_retire(segments, kept_from) == retired


def _checkpoint(root, step, journal_from, accepted):
    d = root / iter_dir_name(step)
    d.mkdir(parents=True)
    (d / META_NAME).write_text(
        json.dumps(
            {
                "complete": True,
                "extra": {"step": step, "accepted_samples": accepted, "journal_from": journal_from},
            }
        )
    )
    return d


def test_fallback_to_the_older_checkpoint_replays_everything_since_it(tmp_path):
    """keep_last=2: checkpoints at steps 1 and 2, samples accepted before, between and after
    them. After step 2's checkpoint the segments since step 1 are still there, so resuming from
    step 1 (step 2 corrupt) replays every sample accepted after it exactly once, and resuming
    from step 2 only those after step 2. A third checkpoint (step 1 pruned) retires them."""
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    paths = RunDir(run, ckpts, "ipc://unused", "ipc://unused")
    batches = [[make_traj(k, i, max_len=24) for i in range(3)] for k in range(4)]
    intake = TrajectoryIntake(f"ipc://{tmp_path}/t.sock", run, group_size=1)
    try:
        intake.journal.append(batches[0])
        first, _, _ = intake.snapshot(str(tmp_path / "b1.bin"))
        _checkpoint(ckpts, 1, first, 3)
        assert intake.after_checkpoint(ckpts) == [1]
        intake.journal.append(batches[1])
        second, _, _ = intake.snapshot(str(tmp_path / "b2.bin"))
        c2 = _checkpoint(ckpts, 2, second, 6)
        assert intake.after_checkpoint(ckpts) == []  # step 1 still kept: keep all
        intake.journal.append(batches[2])
    finally:
        intake.close()

    def ids(ckpt):
        return [t.sample_id for t in paths.journal_since(ckpt)]

    since_1 = [t.sample_id for t in batches[1] + batches[2]]
    assert ids(ckpts / iter_dir_name(1)) == since_1
    assert ids(c2) == [t.sample_id for t in batches[2]]
    assert paths.accepted_samples(ckpts / iter_dir_name(1)) == 3 + 6
    resumed = TrajectoryIntake(f"ipc://{tmp_path}/t2.sock", run, group_size=1)
    try:
        assert resumed.restore(None, 1, accepted_before=3, journal_from=first) == 6
        assert sorted(t.sample_id for t in resumed.buffer.pending()) == sorted(since_1)
        assert resumed.n_accepted == 9
        resumed.journal.append(batches[3])
        third, _, _ = resumed.snapshot(str(tmp_path / "b3.bin"))
        (ckpts / iter_dir_name(1) / META_NAME).unlink()  # pruned by keep_last=2
        assert resumed.after_checkpoint(ckpts) == list(range(first, second))
    finally:
        resumed.close()
    assert [t.sample_id for t in TrajectoryJournal.replay(run / "journal")] == [
        t.sample_id for t in batches[2] + batches[3]
    ]


def test_unreadable_checkpoint_metadata_keeps_every_segment(tmp_path):
    """A kept checkpoint whose metadata cannot be read may still be resumed from (after a
    repair): its segments are unknown, so none is retired."""
    ckpts = tmp_path / "run" / "checkpoints"
    intake = TrajectoryIntake(f"ipc://{tmp_path}/t.sock", tmp_path / "run", group_size=1)
    try:
        intake.journal.append([make_traj(0, 0, max_len=24)])
        first, _, _ = intake.snapshot(str(tmp_path / "b.bin"))
        _checkpoint(ckpts, 2, first, 1)
        (ckpts / iter_dir_name(1)).mkdir()
        (ckpts / iter_dir_name(1) / META_NAME).write_text("{not json")
        assert intake.after_checkpoint(ckpts) == []
        assert len(intake.journal.segments()) == 2
    finally:
        intake.close()

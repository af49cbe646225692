"""Exact resume position with rollout groups of different sizes: the prompt ledger the trainer
keeps (dataplane/prompt_ledger.py) and the cursor the worker rebuilds from it
(rollout/resume.py)."""

import json
from collections import deque

import pytest

from areal_mega.data.dataset import PromptDataset
from areal_mega.dataplane import Trajectory
from areal_mega.dataplane.journal import TrajectoryJournal
from areal_mega.dataplane.prompt_ledger import PromptLedger, resume_plan
from areal_mega.models.tiny import build_char_tokenizer
from areal_mega.rollout.counts import CountCarrier, carried_counts
from areal_mega.rollout.resume import ResumingCursor, accepted_ledger
from areal_mega.rollout.worker import PromptCursor
from areal_mega.run_dir import META_NAME, RunDir


def _traj(prompt, group, j, size):
    return Trajectory.from_tokens(
        [1, 2],
        [3],
        [-0.5],
        [0],
        reward=1.0,
        sample_id=f"g{group}-s{j}",
        group_id=f"g{group}",
        meta={"prompt_index": prompt, "group_size": size},
    )


def _group(prompt, size, group=None):
    return [_traj(prompt, prompt if group is None else group, j, size) for j in range(size)]


def test_variable_group_sizes_count_prompts_not_samples():
    ledger = PromptLedger()
    sizes = {0: 4, 1: 1, 2: 3, 3: 4, 4: 2}  # 14 samples, 5 groups
    for k, n in sizes.items():
        for t in _group(k, n):
            ledger.add(t)
    assert ledger.accepted_prompts() == set(sizes)
    assert ledger.n_accepted_groups() == 5  # samples // n_samples would say 14 // 4 = 3
    assert ledger.done == [[0, 5]]
    assert ledger.partial == {}


def test_partial_group_is_not_accepted_and_survives_a_checkpoint():
    ledger = PromptLedger()
    g = _group(7, 3)
    ledger.add(g[0])
    ledger.add(g[0])  # a resent sample counts once
    state = json.loads(json.dumps(ledger.state()))  # through checkpoint metadata (JSON)
    assert 7 not in PromptLedger(state).accepted_prompts()
    # the rest of the group arrives after the checkpoint, in the journal
    resumed = PromptLedger.replayed(state, g[1:])
    assert resumed.accepted_prompts() == {7}
    assert resumed.partial == {}


def test_regenerated_group_of_a_torn_prompt_is_counted_on_its_own():
    ledger = PromptLedger()
    ledger.add(_group(2, 4, group="old")[0])  # torn by a crash: 1 of 4 arrived
    for t in _group(2, 2, group="new"):  # generated again, 2 samples this time
        ledger.add(t)
    assert ledger.accepted_prompts() == {2}
    assert list(ledger.partial) == ["gold"]


def test_holds_names_the_accepted_samples_of_whole_and_partial_groups():
    ledger = PromptLedger()
    for t in _group(3, 2):
        ledger.add(t)
    ledger.add(_group(5, 3)[1])  # a partial group: its second sample only
    assert ledger.holds(3, "g3-s0") and ledger.holds(3, "any sample of a whole group")
    assert ledger.holds(5, "g5-s1")
    assert not ledger.holds(5, "g5-s0") and not ledger.holds(4, "g4-s0")
    state = json.loads(json.dumps(ledger.state()))
    assert PromptLedger(state).holds(5, "g5-s1") and not PromptLedger(state).holds(5, "g5-s2")


def test_counts_of_deliveries_the_trainer_lacks_ride_again_once(tmp_path):
    """A worker delivers three groups carrying counts; the trainer journals the first and the
    carrier sample of the second (a partial group), then dies with the third in flight. The
    resumed worker (its carrier from the saved state) carries the third's counts again on its
    next delivery: the trainer's metrics hold every count once."""
    counted = {"failed": 0}
    carrier = CountCarrier(lambda: dict(counted))
    groups = [_group(0, 2), _group(1, 2), _group(2, 2)]
    for n, g in zip((1, 2, 4), groups):
        counted["failed"] += n
        carrier.attach(g)
    saved = json.loads(json.dumps({"next_prompt": 3, **carrier.state()}))
    journal = TrajectoryJournal(tmp_path / "journal")
    journal.append(groups[0] + groups[1][:1])
    ledger = PromptLedger.replayed(None, TrajectoryJournal.replay(tmp_path / "journal"))
    resumed = CountCarrier.from_state(lambda: {"failed": 1}, saved)
    assert resumed.carry_again_unless(ledger.holds) == {"failed": 4}
    again = _group(2, 2, group="again")
    assert resumed.attach(again) == {"failed": 5}  # its own 1 and the lost group's 4
    trained = groups[0] + groups[1][:1] + again
    assert carried_counts(trained) == {"rollout/failed": 8.0}
    assert resumed.delivered == {"failed": 8}
    # resumed once more before any other delivery: the same saved state, the same answer
    twice = CountCarrier.from_state(lambda: {}, saved)
    assert twice.carry_again_unless(ledger.holds) == {"failed": 4}
    # the next resume sees only what was delivered since
    later = CountCarrier.from_state(lambda: {}, json.loads(json.dumps(resumed.state())))
    assert later.in_flight == deque([[2, "gagain-s0", {"failed": 5}]])


def test_intervals_merge_out_of_order():
    ledger = PromptLedger()
    for k in [5, 3, 0, 4, 1, 9]:
        for t in _group(k, 1):
            ledger.add(t)
    assert ledger.done == [[0, 2], [3, 6], [9, 10]]
    for t in _group(2, 1):
        ledger.add(t)
    assert ledger.done == [[0, 6], [9, 10]]
    assert ledger.n_accepted_groups() == 7


def test_resume_plan_edge_cases():
    # dropped / in-flight prompts 2 and 5 are drawn but not accepted: generated again, in order
    assert resume_plan({0, 1, 3, 4, 6}, drawn=8) == ([2, 5, 7], 8)
    # the trainer accepted beyond the saved position (state written before a crash)
    assert resume_plan({0, 1, 2, 3}, drawn=2) == ([], 4)
    assert resume_plan(set(), drawn=0) == ([], 0)
    assert resume_plan(set(), drawn=3) == ([0, 1, 2], 3)
    with pytest.raises(ValueError, match="drawn"):
        resume_plan(set(), drawn=-1)


def _numbered_prompts(tmp_path) -> PromptDataset:
    """A real dataset of five numbered prompts (text, no chat template)."""
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": str(i), "answer": str(i)}) + "\n" for i in range(5))
    )
    return PromptDataset(path, build_char_tokenizer("digits"), apply_chat_template=False)


def test_resuming_cursor_regenerates_exactly_the_missing_prompts(tmp_path):
    base = PromptCursor(_numbered_prompts(tmp_path), seed=3, shuffle=True)
    order = [next(iter(base))["prompt"] for _ in range(12)]  # the uninterrupted stream
    cur = ResumingCursor(base.at, redo=[1, 4], start=6)
    it = iter(cur)
    got = [next(it) for _ in range(4)]
    assert [g["prompt_index"] for g in got] == [1, 4, 6, 7]
    assert [g["prompt"] for g in got] == [order[1], order[4], order[6], order[7]]
    assert cur.drawn == 8
    assert cur.delivered(4) == 1  # 1 is still outstanding
    assert cur.delivered(1) == 6
    assert cur.delivered(6) == 7
    assert cur.delivered(7) == 8


def test_accepted_ledger_is_checkpoint_plus_journal(tmp_path):
    paths = RunDir(tmp_path / "run", tmp_path / "ckpt", "ipc://unused-data", "ipc://unused-control")
    ckpt = tmp_path / "ckpt" / "iter_0000002"
    ckpt.mkdir(parents=True)
    state = PromptLedger.replayed(None, _group(0, 2) + _group(1, 3)[:1]).state()
    (ckpt / META_NAME).write_text(json.dumps({"extra": {"accepted_prompts": state}}))
    journal = TrajectoryJournal(paths.journal)
    journal.append(_group(1, 3)[1:] + _group(2, 1))
    journal.close()
    ledger = accepted_ledger(paths, ckpt)
    assert ledger.accepted_prompts() == {0, 1, 2}
    (ckpt / META_NAME).write_text(json.dumps({"extra": {"accepted_samples": 5}}))
    assert accepted_ledger(paths, ckpt) is None  # a checkpoint older than the ledger

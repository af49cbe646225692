"""The shared-prompt layout and the group-aware micro-batch plan
(areal_mega/scheduler/shared_prefix.py): pure functions on plain lists."""

import pytest

from areal_mega.scheduler import PlanError, plan_micro_batches
from areal_mega.scheduler.shared_prefix import (
    first_loss_offsets,
    group_units,
    plan_grouped_micro_batches,
    plan_shared_prefix,
    prompt_groups,
)


def sample(prompt, answer):
    """Tokens, next-token labels and loss mask (rows predicting the answer) of one sample."""
    ids = list(prompt) + list(answer)
    return ids, ids[1:] + [-1], [0] * (len(prompt) - 1) + [1] * len(answer) + [0]


def packed(samples, trailing=0):
    ids, labels, mask, bounds = [], [], [], [0]
    for t, lab, m in samples:
        ids += t
        labels += lab
        mask += m
        bounds.append(len(ids))
    return ids + [0] * trailing, labels + [-1] * trailing, bounds, mask + [0] * trailing


def test_first_loss_offsets_per_slot():
    assert first_loss_offsets([0, 0, 1, 1, 0, 0, 0, 1, 0], [0, 4, 6, 9]) == [2, None, 1]
    assert first_loss_offsets([], [0]) == []


def test_prompt_groups_need_equal_tokens_and_labels_before_the_first_loss_row():
    a, b = sample([5, 6, 7], [1, 2]), sample([5, 6, 7], [3])
    c = sample([5, 6, 8], [1, 2])  # another prompt
    d = sample([9], [4, 4])  # a 1-token prompt: nothing to share
    e = ([5, 6, 7, 1], [6, 7, 1, -1], [0, 0, 0, 0])  # no loss row
    rows = [a, c, b, d, e, a]
    firsts = [next((j for j, m in enumerate(x[2]) if m), None) for x in rows]
    assert prompt_groups([x[0] for x in rows], [x[1] for x in rows], firsts) == [
        [0, 2, 5],
        [1],
        [3],
        [4],
    ]
    # same tokens, other labels (not next-token labels): not the same rows
    f = ([5, 6, 7, 1], [0, 0, 0, -1], [0, 0, 1, 0])
    g = ([5, 6, 7, 2], [6, 7, 1, -1], [0, 0, 1, 0])
    assert prompt_groups([f[0], g[0]], [f[1], g[1]], [2, 2]) == [[0], [1]]


def test_layout_computes_each_prompt_once_and_expands_back():
    a = sample([5, 6, 7, 8], [1, 2])
    b = sample([5, 6, 7, 8], [3])
    c = sample([2, 3], [4, 4, 4])  # alone
    d = sample([5, 6, 7, 8], [9, 9, 9])
    ids, labels, bounds, mask = packed([a, c, b, d], trailing=3)
    lay = plan_shared_prefix(ids, labels, bounds, mask)
    # a's prompt rows 0..2 once; branches start at the last prompt token
    assert lay.saved == 2 * 3
    assert [ids[j] for j in lay.keep] == [
        5,
        6,
        7,
        8,
        1,
        2,
        8,
        3,
        8,
        9,
        9,
        9,
        2,
        3,
        4,
        4,
        4,
        0,
        0,
        0,
    ]
    assert [ids[lay.keep[c]] for c in lay.expand] == ids  # every token is its row
    assert [labels[lay.keep[c]] for c in lay.expand] == labels  # ... with its label
    assert lay.units == [
        (0, 3, 0, 0),
        (3, 3, 0, 3),
        (6, 2, 0, 3),
        (8, 4, 0, 3),
        (12, 5, 0, 0),
        (17, 3, 0, 0),
    ]
    # loss rows are never shared: each maps to a row of its own
    loss_rows = [lay.expand[j] for j, m in enumerate(mask) if m]
    assert len(set(loss_rows)) == len(loss_rows)


@pytest.mark.parametrize(
    "rows",
    [
        [sample([5, 6, 7], [1]), sample([5, 6, 8], [1])],  # different prompts
        [sample([5], [1]), sample([5], [2])],  # 1-token prompts
        [sample([5, 6, 7], [1])],  # one sample
        [],
    ],
)
def test_no_layout_when_nothing_is_shared(rows):
    ids, labels, bounds, mask = packed(rows, trailing=2)
    assert plan_shared_prefix(ids, labels, bounds, mask) is None


def test_group_units_split_groups_at_the_budget():
    # group [0, 1, 2] shares 10 of its 16-token samples; 3 is alone
    units = group_units([[0, 1, 2], [3]], [16, 16, 16, 30], [10, 0], budget=30)
    assert units == [([0, 1, 2], 28), ([3], 30)]
    units = group_units([[0, 1, 2], [3]], [16, 16, 16, 30], [10, 0], budget=25)
    assert units == [([0, 1], 22), ([2], 16), ([3], 30)]  # 3 > 25: the planner names it


def test_grouped_plan_keeps_groups_together_and_counts_computed_tokens():
    prompt = list(range(1, 41))
    rows = [sample(prompt, [7] * 8) for _ in range(8)] + [
        sample([3] + prompt, [7] * 8) for _ in range(8)
    ]
    toks, labs, masks = ([r[i] for r in rows] for i in range(3))
    # 16 samples of 48 tokens (768): with shared prompts each group computes 39 + 8 x 9 = 111
    plan = plan_grouped_micro_batches(toks, labs, masks, max_tokens_per_mb=120, dp_size=2)
    assert [[sorted(mb) for mb in rank] for rank in plan] in (
        [[list(range(8))], [list(range(8, 16))]],
        [[list(range(8, 16))], [list(range(8))]],
    )
    # unshared, the same budget needs 7 micro-batches per rank
    assert len(plan_micro_batches([48] * 16, max_tokens_per_mb=120, dp_size=2)[0]) > 1
    # a budget below a group's cost splits it into pieces
    plan = plan_grouped_micro_batches(toks, labs, masks, max_tokens_per_mb=80, dp_size=1)
    assert sorted(i for mb in plan[0] for i in mb) == list(range(16))
    assert all(len({i // 8 for i in mb}) == 1 for mb in plan[0])
    toks[3] = toks[3] + [7] * 10
    with pytest.raises(PlanError, match="sequence 3: length 58 exceeds"):
        plan_grouped_micro_batches(toks, labs, masks, max_tokens_per_mb=50, dp_size=1)

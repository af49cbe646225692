"""Packed (varlen) attention of the local layer spec (areal_mega/models/varlen_attention.py):
equal outputs and gradients to megatron's dense block-diagonal-mask attention.

The function-level tests compare :func:`varlen_causal_attention` with softmax attention under
:func:`~areal_mega.engine.packed.block_causal_mask` (the CPU path it replaces). The engine
test (tests/helpers/varlen_worker.py, own process) compares the engine's logprobs, gradients and
loss with the dense-mask path of the same model on packed batches of varied lengths."""

import json
import os

import pytest
import torch

from areal_mega.common.net import free_port
from areal_mega.engine.packed import block_causal_mask
from areal_mega.models.varlen_attention import varlen_causal_attention
from tests.helpers.multirank import run_ranks
from tests.helpers.workers import worker_cmd

WORKER = "varlen_worker"  # tests.helpers.varlen_worker
TOL = 1e-5


def _dense(q, k, v, seg, scale):
    """Softmax attention of [T, h, d] under the block-diagonal causal mask (GQA by repeat)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(block_causal_mask(seg)[0], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def _segments(bounds, total):
    seg = torch.full((total,), len(bounds) - 1, dtype=torch.long)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg[s:e] = i
    return seg


GRPO_BOUNDS = [0, 6, 13, 13, 21, 26, 33, 40, 46, 55, 62, 69, 75]  # 11 short slots, one empty


@pytest.mark.parametrize(
    "bounds,total,heads",
    [
        ([0, 7, 8, 30, 33], 33, (4, 2)),  # varied lengths, one of a single token, GQA
        ([0, 12, 20, 44], 50, (6, 2)),  # trailing padding as its own slot
        ([0, 5, 5, 19], 19, (3, 3)),  # an empty slot, plain multi-head attention
        (GRPO_BOUNDS, 75, (4, 2)),  # many short slots: one padded call
        (GRPO_BOUNDS, 79, (3, 3)),  # ... and trailing padding
    ],
)
def test_varlen_equals_dense_mask_forward_and_backward(bounds, total, heads):
    g = torch.Generator().manual_seed(total)
    nq, nkv = heads
    q, k, v = (
        torch.randn(total, n, 16, generator=g, dtype=torch.float64).float().requires_grad_()
        for n in (nq, nkv, nkv)
    )
    scale = 16**-0.5
    out = varlen_causal_attention(q, k, v, bounds, scale=scale)
    assert out.shape == (total, nq, 16)
    want = _dense(q, k, v, _segments(bounds, total), scale)
    assert (out - want).abs().max().item() < TOL
    w = torch.randn(out.shape, generator=g)
    got_grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max().item() < TOL


def test_slots_of_similar_length_share_a_padded_call_and_a_long_one_runs_alone():
    """The plain packed path's plan: slots are units without a context, cut into padded
    batches by width; a slot alone inside its window is a plain causal call (no mask)."""
    from itertools import accumulate

    from areal_mega.models.varlen_attention import plan_varlen_attention

    def batches(lengths, total=None, window=None):
        bounds = [0, *accumulate(lengths)]
        plan = plan_varlen_attention(bounds, total or bounds[-1], window, "cpu")
        return [(tuple(g.q_rows.shape), g.mask is None) for g in plan.groups]

    assert batches([6, 7, 0, 8, 5, 7, 7]) == [((6, 8), False)]  # GRPO-like: one padded call
    assert batches([3, 4, 3, 2000]) == [((3, 4), False), ((1, 2000), True)]
    assert batches([1500, 1000]) == [((1, 1000), True), ((1, 1500), True)]
    assert batches([30], window=8) == [((1, 30), False)]  # past its window: a window mask
    assert batches([5], total=9) == [((2, 5), False)]  # rows past the bounds: one more slot
    assert batches([0, 0]) == []
    empty = torch.zeros(0, 4, 8)
    out = varlen_causal_attention(empty, empty[:, :2], empty[:, :2], [0], scale=0.3)
    assert out.shape == (0, 4, 8)  # no rows


@pytest.mark.parametrize(
    "window,bounds",
    [(1, None), (4, None), (8, None), (64, None), (4, GRPO_BOUNDS), (64, GRPO_BOUNDS)],
)
def test_varlen_sliding_window_equals_dense_window_mask(window, bounds):
    """A window narrows each slot's causal mask to the last ``window`` keys (transformers'
    ``kv_idx > q_idx - window``); slots shorter than the window are plain causal."""
    bounds, total = (bounds, bounds[-1]) if bounds else ([0, 7, 8, 30, 33], 33)
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(total, n, 16, generator=g).requires_grad_() for n in (4, 2, 2))
    out = varlen_causal_attention(q, k, v, bounds, scale=0.25, window=window)
    seg = _segments(bounds, total)
    pos = torch.arange(total)
    outside = (pos.view(-1, 1) - pos.view(1, -1)) >= window
    rep = 2
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(rep, 1)) * 0.25
    scores = scores.masked_fill(block_causal_mask(seg)[0] | outside, float("-inf"))
    want = torch.einsum("hts,shd->thd", scores.softmax(-1), v.repeat_interleave(rep, 1))
    assert (out - want).abs().max().item() < TOL
    w = torch.randn(out.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad((out * w).sum(), (q, k, v)),
        torch.autograd.grad((want * w).sum(), (q, k, v)),
    ):
        assert (a - b).abs().max().item() < TOL
    if window < 8:  # the longer slots really are cut
        full = varlen_causal_attention(q, k, v, bounds, scale=0.25)
        assert (full - out).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "bounds,total,window",
    [
        ([0, 7, 8, 30, 33], 33, None),  # one call per slot
        (GRPO_BOUNDS, 75, None),  # one padded call
        ([0, 7, 8, 30, 33], 33, 4),  # windowed slots
        (GRPO_BOUNDS, 75, 4),
    ],
)
def test_softcapped_scores_equal_the_dense_softcapped_reference(bounds, total, window):
    """Gemma 2's attention-logit soft-capping: scores ``c · tanh(s / c)`` before the mask, on
    every path, forward and backward; a cap far above the scores changes nothing."""
    g = torch.Generator().manual_seed(total)
    q, k, v = ((3 * torch.randn(total, n, 16, generator=g)).requires_grad_() for n in (4, 2, 2))
    cap, scale = 2.0, 16**-0.5
    out = varlen_causal_attention(q, k, v, bounds, scale=scale, window=window, softcap=cap)
    pos = torch.arange(total)
    masked = block_causal_mask(_segments(bounds, total))[0]
    if window is not None:
        masked = masked | ((pos.view(-1, 1) - pos.view(1, -1)) >= window)
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, 1)) * scale
    scores = (torch.tanh(scores / cap) * cap).masked_fill(masked, float("-inf"))
    want = torch.einsum("hts,shd->thd", scores.softmax(-1), v.repeat_interleave(2, 1))
    assert (out - want).abs().max().item() < TOL
    w = torch.randn(out.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad((out * w).sum(), (q, k, v)),
        torch.autograd.grad((want * w).sum(), (q, k, v)),
    ):
        assert (a - b).abs().max().item() < TOL
    plain = varlen_causal_attention(q, k, v, bounds, scale=scale, window=window)
    assert (plain - out).abs().max().item() > 1e-2  # the cap bites at these scores
    loose = varlen_causal_attention(q, k, v, bounds, scale=scale, window=window, softcap=1e6)
    assert (plain - loose).abs().max().item() < TOL


def _gpt_oss_slots(q, k, v, sink, bounds, total, scale, window):
    """transformers' GPT-OSS eager attention (its sinks) of each slot alone: [T, h, d]."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(
        num_key_value_groups=q.shape[1] // k.shape[1], sinks=sink, training=False
    )
    outs = []
    for s, e in zip(bounds[:-1] + [bounds[-1]], bounds[1:] + [total]):
        if e <= s:
            continue
        pos = torch.arange(e - s)
        hidden = pos.view(1, -1) > pos.view(-1, 1)
        if window is not None:
            hidden |= (pos.view(-1, 1) - pos.view(1, -1)) >= window
        mask = torch.zeros(e - s, e - s).masked_fill(hidden, float("-inf"))
        o, _ = eager_attention_forward(
            module, *(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), mask, scale
        )
        outs.append(o[0])
    return torch.cat(outs)


@pytest.mark.parametrize(
    "bounds,total,window",
    [
        ([0, 7, 8, 30, 33], 33, None),  # one call per slot
        ([0, 12, 20, 44], 50, None),  # trailing padding as its own slot
        (GRPO_BOUNDS, 75, None),  # one padded call
        ([0, 7, 8, 30, 33], 33, 4),  # windowed slots
        (GRPO_BOUNDS, 75, 4),
    ],
)
def test_attention_sinks_equal_transformers_gpt_oss_attention(bounds, total, window):
    """GPT-OSS's attention sinks (one learnt logit per head in every row's softmax, without a
    value): each packed path equals transformers' eager GPT-OSS attention of each slot alone,
    forward and backward (the sinks' gradient too); large negative sinks change nothing."""
    g = torch.Generator().manual_seed(total + (window or 0))
    q, k, v = (torch.randn(total, n, 16, generator=g).requires_grad_() for n in (4, 2, 2))
    sink = torch.tensor([2.0, -1.0, 0.5, 3.0], requires_grad=True)
    scale = 16**-0.5
    out = varlen_causal_attention(q, k, v, bounds, scale=scale, window=window, sink=sink)
    want = _gpt_oss_slots(q, k, v, sink, bounds, total, scale, window)
    assert (out - want).abs().max().item() < TOL
    w = torch.randn(out.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad((out * w).sum(), (q, k, v, sink)),
        torch.autograd.grad((want * w).sum(), (q, k, v, sink)),
    ):
        assert (a - b).abs().max().item() < TOL
    plain = varlen_causal_attention(q, k, v, bounds, scale=scale, window=window)
    assert (plain - out).abs().max().item() > 1e-2  # the sinks take weight at these logits
    none = torch.full((4,), -1e4)
    faint = varlen_causal_attention(q, k, v, bounds, scale=scale, window=window, sink=none)
    assert (plain - faint).abs().max().item() < TOL


def test_varlen_is_each_sequence_alone():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, 2, 8, generator=g) for _ in range(3))
    out = varlen_causal_attention(q, k, v, [0, 9, 20], scale=0.5)
    alone = varlen_causal_attention(q[9:], k[9:], v[9:], [0, 11], scale=0.5)
    assert torch.allclose(out[9:], alone, atol=1e-6)


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("varlen") / "res.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ((rc, log),) = run_ranks([worker_cmd(WORKER, free_port(), out)], timeout=240, env=env)
    assert out.exists(), log[-3000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]
    return res


@pytest.mark.parametrize("layout", ["trailing_pad", "padded_slots", "shared_prompts"])
def test_engine_varlen_matches_dense_mask(engine_results, layout):
    r = engine_results
    assert r[f"{layout}.varlen_module"] == "VarlenDotProductAttention"
    assert r[f"{layout}.thd_no_mask"] is True
    for what in ("logprobs", "grads", "loss", "n_tokens"):
        assert r[f"{layout}.{what}"] < TOL, (layout, what, r)
    # the training forward projected fewer rows than tokens, in every micro-batch
    rows, tokens = r[f"{layout}.trained_logit_rows"], r[f"{layout}.tokens"]
    assert len(rows) == len(tokens) and all(0 < a < b for a, b in zip(rows, tokens)), r


def test_engine_computes_shared_prompts_once(engine_results):
    """The micro-batches of groups run fewer rows through the model than they pack (each
    group's prompt but its last token once), the others all of theirs; the results above are
    equal either way."""
    r = engine_results
    # group sizes 4, 1, 3 (prompts 11, 6, 9) and 2, 6 (prompts 1, 23): the 1-token prompt
    # has nothing to share
    assert r["shared_prompts.model_tokens"] == [
        r["shared_prompts.tokens"][0] - 3 * 10 - 2 * 8,
        r["shared_prompts.tokens"][1] - 5 * 22,
    ]
    assert r["shared_prompts.logprobs"] < TOL
    for layout in ("trailing_pad", "padded_slots"):
        assert r[f"{layout}.model_tokens"] == r[f"{layout}.tokens"]


def _tree_case(prompts_and_completions, trailing, seed):
    """A packed batch of groups (tokens of a group's samples equal up to their prompt) and
    its shared-prefix layout (scheduler/shared_prefix.py)."""
    from areal_mega.scheduler.shared_prefix import plan_shared_prefix

    g = torch.Generator().manual_seed(seed)
    ids, labels, mask, bounds = [], [], [], [0]
    for p, comps in prompts_and_completions:
        prompt = torch.randint(0, 50, (p,), generator=g).tolist()
        for n in comps:  # next-token layout: row t is trained on token t + 1
            seq = prompt + torch.randint(0, 50, (n,), generator=g).tolist()
            ids += seq
            labels += seq[1:] + [-1]
            mask += [0] * (p - 1) + [1] * n + [0]
            bounds.append(len(ids))
    ids += [0] * trailing
    labels += [-1] * trailing
    mask += [0] * trailing
    return ids, bounds, plan_shared_prefix(ids, labels, bounds, mask)


@pytest.mark.parametrize(
    "groups,trailing,window",
    [
        ([(9, [3, 5, 1, 4, 2, 6, 3, 3]), (7, [4, 4, 2, 5, 1, 3, 2, 6])], 3, None),  # padded batches
        ([(9, [3, 5, 1, 4, 2, 6, 3, 3]), (7, [4, 4, 2, 5, 1, 3, 2, 6])], 0, 4),  # ... windowed
        ([(40, [3, 30]), (1, [6]), (5, [2])], 2, None),  # few / uneven units: one call each
        ([(40, [3, 30]), (12, [6, 1, 9])], 0, 8),
        ([(20, [16] * 8), (12, [15] * 4)], 0, None),  # long answers: one entry each
        ([(20, [16] * 8), (12, [15] * 4)], 0, 6),
    ],
)
def test_shared_prefix_attention_equals_the_packed_batch(groups, trailing, window):
    """Attention over the compressed rows, read back through ``expand``, equals the packed
    batch's per-sequence attention; the gradients of the compressed rows are the sums over
    their copies."""
    from areal_mega.models.varlen_attention import unit_attention

    ids, bounds, layout = _tree_case(groups, trailing, seed=len(groups) + trailing)
    assert layout is not None and layout.saved > 0
    total = len(ids)
    keep, expand = torch.tensor(layout.keep), torch.tensor(layout.expand)
    g = torch.Generator().manual_seed(total)
    # per-token q, k, v functions of the token and its position, as after the rotary step
    pos = torch.cat(
        [torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])] + [torch.arange(trailing)]
    )
    table = {n: torch.randn(80, 50, n, 8, generator=g) for n in (4, 2)}
    q, k, v = (table[n][pos, torch.tensor(ids)] for n in (4, 2, 2))
    qc, kc, vc = (x[keep].clone().requires_grad_() for x in (q, k, v))
    out = unit_attention(qc, kc, vc, layout.units, scale=8**-0.5, window=window)
    qe, ke, ve = (x.clone().requires_grad_() for x in (q, k, v))
    want = varlen_causal_attention(qe, ke, ve, bounds, scale=8**-0.5, window=window)
    assert (out[expand] - want).abs().max().item() < TOL
    w = torch.randn(want.shape, generator=g)
    got_grads = torch.autograd.grad((out[expand] * w).sum(), (qc, kc, vc))
    want_grads = torch.autograd.grad((want * w).sum(), (qe, ke, ve))
    for a, b in zip(got_grads, want_grads):
        summed = torch.zeros_like(a).index_add_(0, expand, b)
        assert (a - summed).abs().max().item() < TOL


@pytest.mark.parametrize("softcap,sink", [(2.0, None), (None, (2.0, -1.0, 0.5, 3.0))])
def test_softcapped_or_sunk_shared_prefix_attention_equals_the_packed_batch(softcap, sink):
    from areal_mega.models.varlen_attention import unit_attention

    sink = None if sink is None else torch.tensor(sink)
    groups = [(9, [3, 5, 1, 4, 2, 6, 3, 3]), (7, [4, 4, 2, 5, 1, 3, 2, 6])]
    ids, bounds, layout = _tree_case(groups, 0, seed=5)
    g = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])
    table = {n: 3 * torch.randn(80, 50, n, 8, generator=g) for n in (4, 2)}
    q, k, v = (table[n][pos, torch.tensor(ids)] for n in (4, 2, 2))
    keep, expand = torch.tensor(layout.keep), torch.tensor(layout.expand)
    kw = dict(scale=8**-0.5, softcap=softcap, sink=sink)
    out = unit_attention(q[keep], k[keep], v[keep], layout.units, **kw)
    want = varlen_causal_attention(q, k, v, bounds, **kw)
    assert (out[expand] - want).abs().max().item() < TOL


@pytest.mark.parametrize(
    "groups,window",
    [
        ([(9, [3, 5, 1, 4, 2, 6, 3, 3]), (7, [4, 4, 2, 5, 1, 3, 2, 6])], None),  # padded
        ([(9, [3, 5, 1, 4, 2, 6, 3, 3]), (7, [4, 4, 2, 5, 1, 3, 2, 6])], 4),
        ([(40, [3, 30]), (12, [6, 1, 9])], 8),  # one call per unit
    ],
)
def test_a_micro_batchs_attention_plan_is_made_once_and_serves_every_layer(groups, window):
    """The plan (index rows, masks, order) is kept on the micro-batch's packed parameters
    under its window: made once for all layers, another window gets its own, and a layer run
    with the kept plan equals one that plans itself, outputs and gradients bit for bit. The
    same for the plain packed path (slot bounds, one padded call or a call per slot)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from areal_mega.models.varlen_attention import (
        SharedPrefixSeqParams,
        micro_batch_plan,
        plan_unit_attention,
        plan_varlen_attention,
        unit_attention,
    )

    _, bounds, layout = _tree_case(groups, 0, seed=11)
    params = SharedPrefixSeqParams(units=layout.units)
    made = []

    def plan_for(w):
        return micro_batch_plan(
            params,
            ("units", w, "cpu"),
            lambda: made.append(w) or plan_unit_attention(layout.units, w, "cpu"),
        )

    plan = plan_for(window)
    assert plan_for(window) is plan and plan_for(None if window else 5) is not plan
    assert made == [window, None if window else 5]
    t = len(layout.keep)
    g = torch.Generator().manual_seed(t)
    for _layer in range(2):  # each layer its own q, k, v; the same plan
        q, k, v = (torch.randn(t, n, 8, generator=g) for n in (4, 2, 2))
        kw = dict(scale=0.3, window=window)
        runs = []
        for kept in (plan, None):
            x = [y.clone().requires_grad_() for y in (q, k, v)]
            out = unit_attention(*x, layout.units, plan=kept, **kw)
            runs.append((out, torch.autograd.grad(out.square().sum(), x)))
        assert torch.equal(runs[0][0], runs[1][0])
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))

    plain = PackedSeqParams()
    total = bounds[-1]
    slots = micro_batch_plan(
        plain,
        ("slots", window, "cpu", total),
        lambda: plan_varlen_attention(bounds, total, window, "cpu"),
    )
    assert micro_batch_plan(plain, ("slots", window, "cpu", total), lambda: None) is slots
    q, k, v = (torch.randn(total, n, 8, generator=g) for n in (4, 2, 2))
    kept = varlen_causal_attention(q, k, v, bounds, scale=0.3, window=window, plan=slots)
    assert torch.equal(kept, varlen_causal_attention(q, k, v, bounds, scale=0.3, window=window))


def test_grpo_groups_attend_in_two_padded_calls(monkeypatch):
    """4 groups of 8 samples (60-token prompts): one padded call for the prompts, one for the
    branches: with 16-token answers an entry per branch (32), with 6-token ones an entry per
    group (4: its 8 branches side by side, masked from each other, cost less than 32 short
    entries); a group of two uneven answers is one entry; a lone sample (no shared prompt) is
    a plain slot, padded with the prompts."""
    import areal_mega.models.varlen_attention as va

    calls = []
    sdpa = va.F.scaled_dot_product_attention
    monkeypatch.setattr(
        va.F,
        "scaled_dot_product_attention",
        lambda q, *a, **kw: calls.append(tuple(q.shape)) or sdpa(q, *a, **kw),
    )
    for groups, want in (
        ([(60, [16] * 8)] * 4, [(4, 4, 59, 8), (32, 4, 17, 8)]),
        ([(60, [6] * 8)] * 4, [(4, 4, 59, 8), (4, 4, 56, 8)]),
        ([(40, [3, 30])], [(1, 4, 39, 8), (1, 4, 35, 8)]),
        ([(40, [3, 30]), (12, [5])], [(2, 4, 39, 8), (1, 4, 35, 8)]),
    ):
        _, _, layout = _tree_case(groups, 0, seed=3)
        t = len(layout.keep)
        calls.clear()
        va.unit_attention(
            torch.randn(t, 4, 8),
            torch.randn(t, 2, 8),
            torch.randn(t, 2, 8),
            layout.units,
            scale=0.3,
        )
        assert calls == want


def test_batch_entries_group_a_context_only_when_it_costs_less():
    """Pure planning: units of one context become one entry when the padded area (plus a
    per-entry cost) is smaller than that of one entry, or one call, each; units without a
    context, or each with its own, stay alone."""
    from areal_mega.models.varlen_attention import batch_entries

    short = [(100 + 7 * i, 7, 0, 59) for i in range(8)]
    assert batch_entries(short) == [short]
    long = [(100 + 40 * i, 40, 0, 59) for i in range(8)]
    assert batch_entries(long) == [[u] for u in long]
    # uneven: a call each for the short and the long ones costs less than one wide entry
    starts = [100, 101, 102, 104, 107, 227, 229, 230]
    uneven = [(s, n, 0, 59) for s, n in zip(starts, [1, 1, 2, 3, 120, 2, 1, 90])]
    assert batch_entries(uneven) == [[u] for u in uneven]
    two_contexts = short + [(300 + 5 * i, 5, 60, 30) for i in range(4)]
    assert batch_entries(two_contexts) == [short, two_contexts[8:]]
    prompts = [(0, 59, 0, 0), (59, 40, 59, 0)]
    assert batch_entries(prompts) == [[u] for u in prompts]
    own_contexts = [(100, 3, 0, 10), (103, 3, 20, 10)]
    assert batch_entries(own_contexts) == [[u] for u in own_contexts]


def test_split_batches_cuts_by_width_at_the_least_cost():
    """Pure planning: entries sorted by width are cut into padded batches where another call
    costs less than the padding; the cuts are the cheapest of every contiguous split (brute
    force over small random cases); every entry lands in exactly one batch."""
    import itertools
    import random

    from areal_mega.models import varlen_attention as va

    assert va.split_batches([]) == []
    one = [[(100, 7, 0, 59)]]
    assert va.split_batches(one) == [one]
    same = [[(100 + 7 * i, 7, 0, 59)] for i in range(8)]
    assert va.split_batches(same) == [same]
    short = [[(100 + 2 * i, 2, 0, 59)] for i in range(8)]
    long = [[(200 + 120 * i, 120, 0, 59)] for i in range(8)]
    mixed = [e for pair in zip(long, short) for e in pair]
    assert va.split_batches(mixed) == [short, long]
    lone = [[(5000, 1500, 0, 59)]]
    assert va.split_batches(short + lone) == [short, lone]

    def cost(batch):
        lens, spans = va._entry_widths(batch)
        return len(batch) * (max(lens) * max(spans) + va.ENTRY_AREA) + va.CALL_AREA

    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 8)
        entries = [[(10 * i, rng.choice([1, 3, 30, 90, 200]), 0, 59)] for i in range(n)]
        got = va.split_batches(entries)
        assert sorted(e for b in got for e in b) == sorted(entries)
        ordered = sorted(entries, key=lambda e: (e[0][1], e[0][1]))
        brute = min(
            sum(cost(ordered[i:j]) for i, j in zip((0, *cuts), (*cuts, n)))
            for k in range(n)
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert sum(cost(b) for b in got) == brute


@pytest.mark.parametrize("products", ["native", "fp32"])
def test_short_bf16_attention_runs_in_fp32_on_the_cpu(products, monkeypatch):
    """bf16 queries up to CPU_FP32_ATTENTION_MAX_QUERY long attend on fp32 copies (torch's bf16
    CPU kernel is slow there): the fp32 result rounded to bf16, gradients in bf16 close to the
    bf16 kernel's; longer queries keep the bf16 kernel, except on a CPU without bf16 GEMMs
    (``AREAL_MEGA_CPU_BF16_GEMM=fp32`` forces it here), where every bf16 attention is computed
    in fp32, the explicit (softcap) path's products too."""
    import areal_mega.models.varlen_attention as va

    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", products)
    long_dtype = torch.bfloat16 if products == "native" else torch.float32

    seen = []
    sdpa = va.F.scaled_dot_product_attention
    monkeypatch.setattr(
        va.F,
        "scaled_dot_product_attention",
        lambda q, *a, **kw: seen.append(q.dtype) or sdpa(q, *a, **kw),
    )
    g = torch.Generator().manual_seed(0)
    for lq, want in ((va.CPU_FP32_ATTENTION_MAX_QUERY, torch.float32), (200, long_dtype)):
        q, k, v = (
            torch.randn(2, n, lq, 16, generator=g).bfloat16().requires_grad_() for n in (4, 2, 2)
        )
        seen.clear()
        out = va.attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
        assert seen == [want] and out.dtype == torch.bfloat16
        ref = sdpa(q.float(), k.float(), v.float(), is_causal=True, scale=0.25, enable_gqa=True)
        if want == torch.float32:
            assert torch.equal(out, ref.bfloat16())
        assert (out.float() - ref).abs().max() < 0.02
        w = torch.randn(out.shape, generator=g).bfloat16()
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        ref_grads = torch.autograd.grad((ref * w.float()).sum(), (q, k, v))
        for a, b in zip(grads, ref_grads):
            assert a.dtype == torch.bfloat16
            assert (a.float() - b.float()).abs().max() < 0.05 * b.float().abs().max()
    if products == "fp32":
        q, k, v = (torch.randn(2, n, 9, 16, generator=g).bfloat16() for n in (4, 2, 2))
        capped = va.attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True, softcap=5.0)
        wide = va.attention(
            *(t.float() for t in (q, k, v)),
            is_causal=True,
            scale=0.25,
            enable_gqa=True,
            softcap=5.0,
        )
        assert capped.dtype == torch.bfloat16 and torch.equal(capped, wide.bfloat16())

"""Packed (varlen) attention of the local layer spec (areal_mega/models/varlen_attention.py):
equal outputs and gradients to megatron's dense block-diagonal-mask attention.

The function-level tests compare :func:`varlen_causal_attention` with softmax attention under
:func:`~areal_mega.engine.packed.block_causal_mask` (the CPU path it replaces). The engine
test (tests/_varlen_worker.py, own process) compares the engine's logprobs, gradients and loss
with the dense-mask path of the same model on packed batches of varied lengths."""
import json
import os
import sys

import pytest
import torch

from areal_mega.common.net import free_port
from areal_mega.engine.packed import block_causal_mask
from areal_mega.models.varlen_attention import pads_cheaply, varlen_causal_attention
from tests.multirank import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "_varlen_worker.py")
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


GRPO_BOUNDS = [0, 6, 13, 13, 21, 26, 33, 40, 46, 55, 62, 69, 75]    # 11 short slots, one empty


@pytest.mark.parametrize("bounds,total,heads", [
    ([0, 7, 8, 30, 33], 33, (4, 2)),      # varied lengths, one of a single token, GQA
    ([0, 12, 20, 44], 50, (6, 2)),        # trailing padding as its own slot
    ([0, 5, 5, 19], 19, (3, 3)),          # an empty slot, plain multi-head attention
    (GRPO_BOUNDS, 75, (4, 2)),            # many short slots: one padded call
    (GRPO_BOUNDS, 79, (3, 3)),            # ... and trailing padding
])
def test_varlen_equals_dense_mask_forward_and_backward(bounds, total, heads):
    g = torch.Generator().manual_seed(total)
    nq, nkv = heads
    q, k, v = (torch.randn(total, n, 16, generator=g, dtype=torch.float64).float()
               .requires_grad_() for n in (nq, nkv, nkv))
    scale = 16 ** -0.5
    out = varlen_causal_attention(q, k, v, bounds, scale=scale)
    assert out.shape == (total, nq, 16)
    want = _dense(q, k, v, _segments(bounds, total), scale)
    assert (out - want).abs().max().item() < TOL
    w = torch.randn(out.shape, generator=g)
    got_grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max().item() < TOL


def test_many_short_slots_take_one_padded_call_and_few_or_long_ones_do_not():
    assert pads_cheaply([6, 7, 0, 8, 5, 7, 7])         # GRPO-like: 6 real slots, little padding
    assert not pads_cheaply([7, 1, 22])                # too few slots to matter
    assert not pads_cheaply([7, 1, 22, 3])             # padding to 22 would be 88 of 33 tokens
    assert not pads_cheaply([0, 0, 0, 0, 0])
    assert pads_cheaply([10, 10, 10, 10]) and not pads_cheaply([1, 1, 1, 40])


@pytest.mark.parametrize("window,bounds", [(1, None), (4, None), (8, None), (64, None),
                                           (4, GRPO_BOUNDS), (64, GRPO_BOUNDS)])
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
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                    torch.autograd.grad((want * w).sum(), (q, k, v))):
        assert (a - b).abs().max().item() < TOL
    if window < 8:    # the longer slots really are cut
        full = varlen_causal_attention(q, k, v, bounds, scale=0.25)
        assert (full - out).abs().max().item() > 1e-3


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
    (rc, log), = run_ranks([[sys.executable, WORKER, free_port(), out]], timeout=240, env=env)
    assert out.exists(), log[-3000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]
    return res


@pytest.mark.parametrize("layout", ["trailing_pad", "padded_slots"])
def test_engine_varlen_matches_dense_mask(engine_results, layout):
    r = engine_results
    assert r[f"{layout}.varlen_module"] == "VarlenDotProductAttention"
    assert r[f"{layout}.thd_no_mask"] is True
    for what in ("logprobs", "grads", "loss", "n_tokens"):
        assert r[f"{layout}.{what}"] < TOL, (layout, what, r)
    # the training forward projected fewer rows than tokens, in every micro-batch
    rows, tokens = r[f"{layout}.trained_logit_rows"], r[f"{layout}.tokens"]
    assert len(rows) == len(tokens) and all(0 < a < b for a, b in zip(rows, tokens)), r

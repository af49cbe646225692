"""The CPU gated delta-net kernels (areal_mega/compat/gdn_cpu.py) against transformers' torch
implementations (Qwen3-Next), packed sequences included, forward and backward. The megatron
module they serve is compared with transformers' layer in tests/helpers/compat_probe_worker.py
(tests/test_engine_compat.py)."""

import pytest
import torch
import torch.nn.functional as F

from areal_mega.compat import gdn_cpu

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

LENGTHS = [70, 5, 130, 1]  # across chunk boundaries (64), a one-token sequence


def _inputs(heads=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    q, k = (torch.randn(1, t, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(1, t, heads, dv, generator=g)
    decay = -2 * torch.rand(1, t, heads, generator=g)
    beta = torch.rand(1, t, heads, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def _bounds():
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return cu, list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def _close(got, want, rel=1e-5):
    got, want = got.detach(), want.detach()
    assert float((got - want).abs().max()) <= rel * float(want.abs().max())


def test_packed_rule_equals_transformers_recurrence_per_sequence():
    ins = _inputs()
    cu, bounds = _bounds()
    got, _ = gdn_cpu.chunk_gated_delta_rule(*ins, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    want = torch.cat(
        [
            qwen3_next.torch_recurrent_gated_delta_rule(
                *(x[:, s:e] for x in ins),
                initial_state=None,
                output_final_state=False,
                use_qk_l2norm_in_kernel=True,
            )[0]
            for s, e in bounds
        ],
        dim=1,
    )
    _close(got, want)
    dy = torch.randn_like(got)
    for a, b in zip(
        torch.autograd.grad((got * dy).sum(), ins), torch.autograd.grad((want * dy).sum(), ins)
    ):
        _close(a, b)


def test_final_state_and_batched_input_equal_transformers_chunked():
    q, k, v, g, beta = (x.detach()[:, :130] for x in _inputs(seed=1))
    state0 = torch.randn(1, 4, 16, 24)
    got, got_state = gdn_cpu.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=state0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    want, want_state = qwen3_next.torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=state0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    _close(got, want)
    _close(got_state, want_state)


def test_packed_causal_conv_restarts_each_sequence():
    cu, bounds = _bounds()
    x = torch.randn(1, int(cu[-1]), 12, requires_grad=True)
    w, bias = torch.randn(12, 4), torch.randn(12)
    got, state = gdn_cpu.causal_conv1d(x, w, bias, "silu", cu_seqlens=cu)
    assert state is None
    want = torch.cat(
        [
            F.silu(F.conv1d(x[:, s:e].transpose(1, 2), w[:, None], bias, padding=3, groups=12))[
                ..., : e - s
            ].transpose(1, 2)
            for s, e in bounds
        ],
        dim=1,
    )
    _close(got, want)
    with pytest.raises(NotImplementedError, match="state"):
        gdn_cpu.causal_conv1d(x, w, output_final_state=True)


def test_l2norm_matches_transformers():
    x = torch.randn(3, 5, 16)
    _close(gdn_cpu.l2norm(x), qwen3_next.l2norm(x))

"""The CPU speed patch of megatron's tensor-parallel linear layers: each GEMM goes through
oneDNN and equals the torch expression it replaces (forward, input and weight gradients)."""

import pytest
import torch
import torch.nn.functional as F

from areal_mega.compat import cpu_gemm, megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patch")


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_each_function_equals_the_expression_it_replaces(monkeypatch):
    assert cpu_gemm._AVAILABLE, "this torch has no oneDNN linear: the speed patch is a no-op"
    g = torch.Generator().manual_seed(0)
    x3 = torch.randn(37, 2, 24, generator=g)  # [s, b, K] as megatron passes it
    w = torch.randn(40, 24, generator=g)
    _close(cpu_gemm.linear(x3, w), torch.matmul(x3, w.t()))
    # not a view: megatron's cross entropy modifies the logits in place
    assert not cpu_gemm.linear(x3, w)._is_view()
    assert not cpu_gemm.grad_input(torch.randn(37, 2, 40), w)._is_view()
    _close(cpu_gemm.linear(x3.transpose(0, 1), w), torch.matmul(x3.transpose(0, 1), w.t()))
    gy = torch.randn(37, 2, 40, generator=g)
    _close(cpu_gemm.grad_input(gy, w), gy.matmul(w))
    g2, x2 = gy.view(-1, 40), x3.reshape(-1, 24)
    _close(cpu_gemm.grad_weight(g2, x2), g2.t().matmul(x2))
    _close(cpu_gemm.grad_weight(g2.t().contiguous().t(), x2), g2.t().matmul(x2))
    empty = torch.zeros(0, 24)
    assert cpu_gemm.linear(empty, w).shape == (0, 40)
    xb, wb = x3.bfloat16(), w.bfloat16()  # other dtypes: torch's own matmul
    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "native")
    assert torch.equal(cpu_gemm.linear(xb, wb), torch.matmul(xb, wb.t()))


def _within_bf16_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` (bf16) is ``exact`` (fp64) rounded to bf16, give or take the fp32 sum's
    order: within one bf16 unit in the last place."""
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    ulp = exact.abs().clamp_min(1e-30) * 2.0**-7
    assert ((got.double() - exact).abs() <= ulp).all()


@pytest.mark.parametrize("block_bytes", [8 << 20, 200])
def test_bf16_products_computed_in_fp32_where_the_cpu_has_no_bf16_gemm(block_bytes, monkeypatch):
    """On a CPU without bf16 GEMMs (forced here by ``AREAL_MEGA_CPU_BF16_GEMM=fp32``, on any
    CPU): each product of bf16 operands is the fp32 product of the widened operands rounded
    to bf16 once, whole or by blocks of the weight's rows (``WIDEN_BLOCK_BYTES`` lowered),
    in megatron's shapes, not a view."""
    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "fp32")
    monkeypatch.setattr(cpu_gemm, "WIDEN_BLOCK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(3)
    x3 = torch.randn(37, 2, 24, generator=g).bfloat16()
    w = torch.randn(40, 24, generator=g).bfloat16()
    y = cpu_gemm.linear(x3, w)
    assert not y._is_view()
    _within_bf16_rounding(y, x3.double() @ w.double().t())
    gy = torch.randn(37, 2, 40, generator=g).bfloat16()
    gi = cpu_gemm.grad_input(gy, w)
    assert not gi._is_view()
    _within_bf16_rounding(gi, gy.double() @ w.double())
    g2, x2 = gy.view(-1, 40), x3.reshape(-1, 24)
    _within_bf16_rounding(cpu_gemm.grad_weight(g2, x2), g2.double().t() @ x2.double())
    assert cpu_gemm.linear(torch.zeros(0, 24, dtype=torch.bfloat16), w).shape == (0, 40)


@pytest.mark.parametrize("frozen", [False, True])
def test_patched_megatron_linear_runs_onednn_and_matches_f_linear(frozen):
    megatron_cpu.apply()
    from megatron.core.tensor_parallel import layers

    g = torch.Generator().manual_seed(1)
    x = torch.randn(33, 3, 16, generator=g, requires_grad=True)
    w = torch.randn(20, 16, generator=g, requires_grad=not frozen)
    b = torch.randn(20, generator=g, requires_grad=not frozen)  # frozen: no bias grad either
    leaves = [x] + ([] if frozen else [w, b])

    def grads(forward):
        for t in leaves:
            t.grad = None
        y = forward()
        y.square().sum().backward()
        return [y.detach()] + [t.grad.clone() for t in leaves]

    def megatron_linear():
        if frozen:
            return layers.LinearWithFrozenWeight.apply(x, w, b, False, None)
        # (input, weight, bias, grad_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        #  grad_output_buffer, wgrad_deferral_limit, tp_group, gtp_remat_size)
        return layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
            x, w, b, False, False, False, None, 0, None, 1
        )

    with torch.profiler.profile() as prof:
        got = grads(megatron_linear)
    ops = [e.name for e in prof.events()]
    assert ops.count("mkldnn::_linear_pointwise") == (2 if frozen else 3), sorted(set(ops))
    want = grads(lambda: F.linear(x, w, b))
    for a, b_ in zip(got, want):
        _close(a, b_)


def test_env_switch_selects_torch_matmul_or_rejects_unknown_values():
    import os
    import subprocess
    import sys

    code = "from areal_mega.compat import cpu_gemm; print(cpu_gemm._AVAILABLE)"

    def run(value):
        env = dict(os.environ, AREAL_MEGA_CPU_GEMM=value)
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    torch_run = run("torch")
    assert torch_run.returncode == 0, torch_run.stderr
    assert torch_run.stdout.strip() == "False"
    bad = run("mkl")
    assert bad.returncode != 0
    assert "AREAL_MEGA_CPU_GEMM" in bad.stderr and "onednn, torch" in bad.stderr, bad.stderr


def test_reused_output_is_handed_out_again_only_once_nothing_uses_it():
    pool = cpu_gemm.ReusedOutput()
    a = pool.take((3, 5), torch.bfloat16)
    a.fill_(1.0)
    b = pool.take((3, 5), torch.bfloat16)  # a is alive: a tensor of its own
    assert b.data_ptr() != a.data_ptr()
    b.fill_(2.0)
    assert torch.equal(a, torch.ones(3, 5, dtype=torch.bfloat16))
    view = a[1:]
    del a, b
    c = pool.take((2, 5), torch.bfloat16)  # a view of the buffer still holds it
    assert c.data_ptr() != view.data_ptr() - 5 * 2
    base_ptr = view.data_ptr() - 5 * 2
    del view, c
    d = pool.take((2, 7), torch.bfloat16)  # nothing uses it: the same storage, a new shape
    assert d.data_ptr() == base_ptr and d.shape == (2, 7) and not d._is_view()
    del d
    e = pool.take((4, 5), torch.float32)  # another dtype: a new tensor, which becomes the buffer
    assert e.dtype == torch.float32 and e.shape == (4, 5)
    ptr = e.data_ptr()
    del e
    assert pool.take((4, 5), torch.float32).data_ptr() == ptr


@pytest.mark.parametrize("products", ["native", "fp32"])
def test_large_bf16_forward_products_reuse_one_buffer_through_megatron_linear(
    products, monkeypatch
):
    """Over REUSE_MIN_BYTES (lowered here): the product equals torch's (``native``; ``fp32``:
    the widened operands' product rounded, by blocks of the weight), is not a view, may be
    written in place under autograd, and the next step's product takes the same storage while
    the gradients stay right."""
    megatron_cpu.apply()
    from megatron.core.tensor_parallel import layers

    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", products)
    monkeypatch.setattr(cpu_gemm, "WIDEN_BLOCK_BYTES", 300)
    monkeypatch.setattr(cpu_gemm, "REUSE_MIN_BYTES", 1)
    monkeypatch.setattr(cpu_gemm, "_REUSED", cpu_gemm.ReusedOutput())
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 16, generator=g).bfloat16().requires_grad_(True)
    ptrs = []
    for _ in range(3):
        x = torch.randn(9, 2, 16, generator=g).bfloat16().requires_grad_(True)
        y = layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
            x, w, None, False, False, False, None, 0, None, 1
        )
        if products == "native":
            assert torch.equal(y, torch.matmul(x.detach(), w.detach().t()))
        else:
            _within_bf16_rounding(y, x.detach().double() @ w.detach().double().t())
        assert not y._is_view()
        ptrs.append(y.data_ptr())
        y2 = y * 1.0
        y2.mul_(2.0)  # an in-place write downstream, as megatron's cross entropy does
        w.grad = None
        y2.float().square().sum().backward()
        gy = (4.0 * 2.0 * y.detach().float()).bfloat16()
        torch.testing.assert_close(
            x.grad.float(), (gy.float() @ w.detach().float()), rtol=2e-2, atol=2e-2
        )
        del y, y2
    assert ptrs[1] == ptrs[2]

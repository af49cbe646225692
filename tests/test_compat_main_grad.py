"""The split gradient add (areal_mega/compat/main_grad.py): the values of ``add_``, bit for
bit, and installed in megatron's DDP backward hook on CPU."""

import inspect

import pytest
import torch

from areal_mega.compat import main_grad, megatron_cpu


def _pair(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(n, generator=g)
    src = (torch.randn(n, generator=g) * 1e-3).to(dtype)
    src[:3] = torch.tensor([float("inf"), -0.0, 1e-40]).to(dtype)
    return dst, src


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "n", [10, main_grad.MIN_SPLIT - 1, main_grad.MIN_SPLIT, main_grad.MIN_SPLIT + 12345]
)
def test_equals_add_bit_for_bit(dtype, n):
    want, src = _pair(n, dtype)
    got = want.clone()
    want.add_(src)
    main_grad.accumulate(got, src)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))


def test_two_dimensional_and_non_contiguous():
    rows = main_grad.MIN_SPLIT // 64 + 7
    dst, src = _pair(rows * 64, torch.bfloat16)
    dst, src = dst.view(rows, 64), src.view(rows, 64)
    want = dst.clone().add_(src)
    main_grad.accumulate(dst, src)
    assert torch.equal(want, dst)
    # a transposed gradient goes through add_ in one call: same values
    t_dst = torch.zeros(64, rows)
    main_grad.accumulate(t_dst, src.t())
    assert torch.equal(t_dst, src.t().float())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply without CUDA")
def test_installed_in_the_ddp_backward_hook():
    megatron_cpu.apply()
    from megatron.core.distributed import distributed_data_parallel as ddp

    hook_factory = ddp.DistributedDataParallel._make_backward_post_hook
    assert hook_factory.__wrapped_original__ is not hook_factory
    assert ddp._areal_accumulate_grad is main_grad.accumulate
    names = hook_factory.__code__.co_consts
    inner = next(c for c in names if hasattr(c, "co_names") and c.co_name == "hook")
    assert "_areal_accumulate_grad" in inner.co_names


def _wgrad_inputs(dtype, tokens=7, n=main_grad.MIN_SPLIT // 64 + 5, k=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    grad_output = torch.randn(tokens, n, generator=g).to(dtype)
    total_input = torch.randn(tokens, k, generator=g).to(dtype)
    start = torch.randn(n, k, generator=g)
    return grad_output, total_input, start


def test_bf16_weight_gradient_added_piecewise_equals_whole_product_added(monkeypatch):
    """Without the fp32-summing GEMM (here: set aside by the backend switch): rows in pieces,
    each the bf16 product added in fp32, the same values as the whole bf16 product added into
    the main gradient (what DDP's hook did). torch's bf16 products, also on a CPU without
    bf16 GEMMs (``native``)."""
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "torch")
    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "native")
    assert not main_grad.fused_bf16_available()
    go, x, start = _wgrad_inputs(torch.bfloat16)
    want = start.clone().add_(go.t().matmul(x))
    got = start.clone()
    main_grad.accumulate_weight_grad(got, go, x)
    assert torch.equal(got, want)


def test_fp32_weight_gradient_added_in_one_addmm():
    go, x, start = _wgrad_inputs(torch.float32)
    want = start.double() + go.double().t() @ x.double()
    got = start.clone()
    main_grad.accumulate_weight_grad(got, go, x)
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_grad_returns_the_product_below_the_split_size_or_without_main_grad(
    dtype, monkeypatch
):
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "torch")
    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "native")
    go, x, _ = _wgrad_inputs(dtype, n=128)
    w = torch.nn.Parameter(torch.zeros(128, 64, dtype=dtype))
    want = go.t().matmul(x)
    assert torch.allclose(main_grad.weight_grad(go, x, w), want, rtol=1e-2, atol=1e-4)
    w.main_grad = torch.zeros(128, 64)
    assert main_grad.weight_grad(go, x, w) is not None
    assert w.main_grad.abs().sum() == 0


@pytest.mark.parametrize(("tokens", "n", "k"), [(7, 128, 64), (33, 4099, 96), (1, 3, 5)])
def test_bf16_weight_gradient_computed_in_fp32_where_the_cpu_has_no_bf16_gemm(
    tokens, n, k, monkeypatch
):
    """On a CPU without bf16 GEMMs (here forced by ``AREAL_MEGA_CPU_BF16_GEMM=fp32``, on any
    CPU): the widened operands' fp32 product summed into ``main_grad`` in pieces of rows, as
    close to the fp64 product as fp32 sums get and closer than the bf16 product added; at any
    size no ``.grad`` product is returned; a strided gradient and an empty batch are handled."""
    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "fp32")
    monkeypatch.setattr(main_grad, "PIECE", 4 * k)  # several pieces even at these sizes
    go, x, start = _wgrad_inputs(torch.bfloat16, tokens=tokens, n=n, k=k)
    exact = start.double() + go.double().t() @ x.double()
    w = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.bfloat16))
    w.main_grad = start.clone()
    assert main_grad.weight_grad(go, x, w) is None
    err = (w.main_grad.double() - exact).abs().max().item()
    assert err < 1e-5 * max(1.0, tokens**0.5)
    rounded = (start + go.double().t().matmul(x.double()).bfloat16().float()).double()
    assert err < (rounded - exact).abs().max().item() or tokens == 1
    wide_go = torch.zeros(tokens, 2 * n, dtype=torch.bfloat16)
    wide_go[:, 1::2] = go
    w.main_grad = start.clone()
    assert main_grad.weight_grad(wide_go[:, 1::2], x, w) is None
    assert (w.main_grad.double() - exact).abs().max().item() == err
    before = w.main_grad.clone()
    assert main_grad.weight_grad(go[:0], x[:0], w) is None
    assert torch.equal(w.main_grad, before)


FUSED = pytest.mark.skipif(
    not main_grad.fused_bf16_available(),
    reason="no bf16 GEMM in oneDNN on this CPU, or the C++ kernels are not built",
)


def _gemms():
    from areal_mega.common import native

    ops = native.load("_ops_cpu")
    has_mkl = ops is not None and getattr(ops, "has_mkl_gemm_bf16", lambda: False)()
    no_mkl = pytest.mark.skipif(not has_mkl, reason="this torch carries no MKL bf16 GEMM")
    return ["onednn", pytest.param("mkl", marks=no_mkl)]


@FUSED
@pytest.mark.parametrize("gemm", _gemms())
@pytest.mark.parametrize(("tokens", "n", "k"), [(7, 128, 64), (33, 4099, 96), (1, 3, 5)])
def test_bf16_weight_gradient_summed_in_fp32_into_main_grad(tokens, n, k, gemm, monkeypatch):
    """The fused path, by each GEMM: main_grad + the product summed in fp32, as close to the
    fp64 product as fp32 sums get, and closer than the bf16 product added (the former path)."""
    monkeypatch.setattr(main_grad, "_GEMM", gemm)
    go, x, start = _wgrad_inputs(torch.bfloat16, tokens=tokens, n=n, k=k)
    exact = start.double() + go.double().t() @ x.double()
    got = start.clone()
    main_grad.accumulate_weight_grad(got, go, x)
    err = (got.double() - exact).abs().max().item()
    assert err < 1e-5 * max(1.0, tokens**0.5)
    rounded = (start + go.t().matmul(x).float()).double()
    assert err < (rounded - exact).abs().max().item() or tokens == 1


@FUSED
@pytest.mark.parametrize("gemm", _gemms())
def test_bf16_weight_gradient_of_any_size_goes_into_main_grad(gemm, monkeypatch):
    """Below the split size too: no ``.grad`` product is returned, the gradient is in
    ``main_grad``; a strided input and gradient and an empty batch are handled."""
    monkeypatch.setattr(main_grad, "_GEMM", gemm)
    go, x, start = _wgrad_inputs(torch.bfloat16, n=128)
    w = torch.nn.Parameter(torch.zeros(128, 64, dtype=torch.bfloat16))
    w.main_grad = start.clone()
    assert main_grad.weight_grad(go, x, w) is None
    exact = start.double() + go.double().t() @ x.double()
    assert (w.main_grad.double() - exact).abs().max() < 1e-5
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=torch.bfloat16)
    wide[:, ::2] = x  # stride (128, 2): copied once
    w.main_grad = start.clone()
    assert main_grad.weight_grad(go, wide[:, ::2], w) is None
    assert (w.main_grad.double() - exact).abs().max() < 1e-5
    wide_go = torch.zeros(go.shape[0], 2 * go.shape[1], dtype=torch.bfloat16)
    wide_go[:, 1::2] = go
    w.main_grad = start.clone()
    assert main_grad.weight_grad(wide_go[:, 1::2], x, w) is None
    assert (w.main_grad.double() - exact).abs().max() < 1e-5
    before = w.main_grad.clone()
    assert main_grad.weight_grad(go[:0], x[:0], w) is None
    assert torch.equal(w.main_grad, before)


@FUSED
def test_fused_op_names_a_bad_argument():
    from areal_mega.common import native

    op = native.load("_ops_cpu").accumulate_weight_grad_bf16
    go, x, start = _wgrad_inputs(torch.bfloat16, n=128)
    with pytest.raises(RuntimeError, match="main_grad must be a contiguous 2-D float32"):
        op(start.to(torch.bfloat16), go, x)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op(start, go.float(), x)
    with pytest.raises(RuntimeError, match=r"expected grad_output \[T, N\]"):
        op(start, go[:, :-1], x)
    with pytest.raises(RuntimeError, match="gemm must be mkl or onednn"):
        op(start, go, x, gemm="blas")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply without CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_megatron_linear_backward_adds_a_large_weight_gradient_into_main_grad(dtype):
    """megatron's linear autograd function, as patched: a weight of MIN_SPLIT elements or more
    gets no ``.grad``; its gradient is in ``main_grad``, and the input gradient is unchanged."""
    megatron_cpu.apply()
    from megatron.core.tensor_parallel import layers

    go, x, start = _wgrad_inputs(dtype)
    w = torch.nn.Parameter(torch.randn(go.shape[1], x.shape[1]).to(dtype))
    w.main_grad = start.clone()
    x = x.clone().requires_grad_(True)
    out = layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
        x, w, None, False, False, False, None, None, None, 1
    )
    out.backward(go)
    assert w.grad is None
    want = start.clone()
    main_grad.accumulate_weight_grad(want, go, x.detach())
    assert torch.equal(w.main_grad, want)
    assert torch.allclose(x.grad.float(), (go.float() @ w.detach().float()), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply without CUDA")
def test_installed_in_megatron_linear_backward():
    megatron_cpu.apply()
    from megatron.core.tensor_parallel import layers

    backward = inspect.unwrap(layers.LinearWithGradAccumulationAndAsyncCommunication.backward)
    assert layers._areal_weight_grad is main_grad.weight_grad
    assert "_areal_weight_grad" in backward.__code__.co_names

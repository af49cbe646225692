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


def test_bf16_weight_gradient_added_piecewise_equals_whole_product_added():
    """Rows in pieces, each the bf16 product added in fp32: the same values as the whole
    bf16 product added into the main gradient (what DDP's hook did)."""
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
def test_weight_grad_returns_the_product_below_the_split_size_or_without_main_grad(dtype):
    go, x, _ = _wgrad_inputs(dtype, n=128)
    w = torch.nn.Parameter(torch.zeros(128, 64, dtype=dtype))
    want = go.t().matmul(x)
    assert torch.allclose(main_grad.weight_grad(go, x, w), want, rtol=1e-2, atol=1e-4)
    w.main_grad = torch.zeros(128, 64)
    assert main_grad.weight_grad(go, x, w) is not None
    assert w.main_grad.abs().sum() == 0


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

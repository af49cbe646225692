"""The split gradient add (areal_mega/compat/main_grad.py): the values of ``add_``, bit for
bit, and installed in megatron's DDP backward hook on CPU."""

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

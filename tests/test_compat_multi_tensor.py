"""The optimizer's tensor-list scale on CPU (areal_mega/compat/multi_tensor.py): the values of
megatron-core's own fallback, bit for bit, and installed where megatron's optimizer calls it."""

import pytest
import torch

from areal_mega.compat import megatron_cpu
from areal_mega.compat.multi_tensor import multi_tensor_scale


def _tensors(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(shape, generator=g).to(dtype) for shape in ((7, 5), (33,), (4, 3, 2))]
    out[0][0, :3] = torch.tensor([float("inf"), float("nan"), -0.0]).to(dtype)
    return out


def _upstream():
    from megatron.core.utils import local_multi_tensor_scale

    return local_multi_tensor_scale


def _same(a, b):
    return all(
        x.dtype == y.dtype
        and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("scale", [0.37, 1.0])
def test_in_place_scale_equals_upstream(scale):
    want, got = _tensors(), _tensors()
    _upstream()(2048, None, [want, want], scale)
    multi_tensor_scale(2048, None, [got, got], scale)
    assert _same(want, got)
    if scale != 1.0:
        assert not _same(got, _tensors())  # it did scale


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_copy_into_other_tensors_equals_upstream(dst_dtype, scale):
    src = _tensors()
    want = [torch.zeros_like(t, dtype=dst_dtype) for t in src]
    got = [torch.zeros_like(t, dtype=dst_dtype) for t in src]
    _upstream()(2048, None, [src, want], scale)
    multi_tensor_scale(2048, None, [src, got], scale)
    assert _same(want, got)
    assert _same(src, _tensors())  # the sources are untouched


def test_empty_lists():
    multi_tensor_scale(2048, None, [[], []], 0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply without CUDA")
def test_installed_where_the_optimizer_calls_it():
    megatron_cpu.apply()
    from megatron.core.optimizer import clip_grads, optimizer

    assert clip_grads.multi_tensor_scale_impl is multi_tensor_scale
    assert optimizer.multi_tensor_scale_impl is multi_tensor_scale
    # the bf16 model parameters' update from the fp32 main parameters
    main = _tensors()
    model = [torch.zeros_like(t, dtype=torch.bfloat16) for t in main]
    optimizer._multi_tensor_copy_this_to_that(main, model, torch.zeros(1, dtype=torch.int))
    assert _same(model, [t.to(torch.bfloat16) for t in main])
    # the gradient clip: every gradient scaled by max_norm / (total_norm + 1e-6)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in main]
    for p, t in zip(params, _tensors(seed=1)):
        p.grad = t.clone()
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    want = _tensors(seed=1)
    _upstream()(2048, None, [want, want], 1.0 / (4.0 + 1.0e-6))
    assert _same([p.grad for p in params], want)

"""The word embedding whose backward adds its rows into the weight's main gradient
(areal_mega/compat/embedding_grad.py): the dense path's gradient, tied or not, and installed in
megatron's ``VocabParallelEmbedding`` on CPU. Under megatron's DDP it is checked against plain
autograd in tests/test_engine_multirank.py (every CPU layout)."""

import pytest
import torch
import torch.nn.functional as F

from areal_mega.compat import embedding_grad, megatron_cpu


def _case(dtype, vocab=50, hidden=8, tokens=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    ids[0, :5] = 3  # repeated rows accumulate
    weight = torch.randn(vocab, hidden, generator=g).to(dtype)
    upstream = torch.randn(2, tokens // 2, hidden, generator=g).to(dtype)
    return ids, weight, upstream


def _dense_grad(ids, weight, upstream, head=None):
    w = torch.nn.Parameter(weight.clone())
    loss = (F.embedding(ids, w) * upstream).sum()
    if head is not None:
        loss = loss + (head @ w.t()).sum()
    loss.backward()
    return w.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_go_into_main_grad_and_the_weight_gets_no_grad(dtype):
    ids, weight, upstream = _case(dtype)
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.full(weight.shape, 0.5)
    out = embedding_grad.embedding(ids, w)
    assert torch.equal(out, F.embedding(ids, weight))
    (out * upstream).sum().backward()
    assert w.grad is None
    want = 0.5 + _dense_grad(ids, weight, upstream)
    tol = 1e-6 if dtype == torch.float32 else 3e-2  # the dense path sums bf16 rows in bf16
    assert (w.main_grad - want).abs().max() < tol


def test_tied_output_layer_gradient_still_reaches_the_weight():
    """A weight also used by an output layer: the embedding's rows go into main_grad, the
    output layer's gradient into ``.grad`` (DDP's hook adds it); together the dense total."""
    ids, weight, upstream = _case(torch.float32)
    head = torch.randn(6, weight.shape[1], generator=torch.Generator().manual_seed(1))
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.zeros(weight.shape)
    loss = (embedding_grad.embedding(ids, w) * upstream).sum() + (head @ w.t()).sum()
    loss.backward()
    total = w.main_grad + w.grad
    assert (total - _dense_grad(ids, weight, upstream, head)).abs().max() < 1e-5


def test_without_main_grad_or_grad_the_lookup_is_f_embedding():
    ids, weight, upstream = _case(torch.float32)
    w = torch.nn.Parameter(weight.clone())
    (embedding_grad.embedding(ids, w) * upstream).sum().backward()
    assert torch.equal(w.grad, _dense_grad(ids, weight, upstream))
    frozen = torch.nn.Parameter(weight.clone(), requires_grad=False)
    frozen.main_grad = torch.zeros(weight.shape)
    assert not embedding_grad.embedding(ids, frozen).requires_grad
    with torch.no_grad():
        w.main_grad = torch.zeros(weight.shape)
        assert torch.equal(embedding_grad.embedding(ids, w), F.embedding(ids, weight))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply without CUDA")
def test_installed_in_vocab_parallel_embedding():
    megatron_cpu.apply()
    from megatron.core.tensor_parallel import layers

    forward = layers.VocabParallelEmbedding.forward
    assert forward.__wrapped_original__ is not forward
    assert layers._areal_embedding is embedding_grad.embedding
    assert "_areal_embedding" in forward.__code__.co_names
    assert "embedding" in forward.__wrapped_original__.__code__.co_names  # F.embedding
    assert "embedding" not in forward.__code__.co_names

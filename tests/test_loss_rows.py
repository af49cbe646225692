"""Logits only at the loss rows (areal_mega/engine/loss_rows.py): which rows, the output
processor handed to megatron-core's GPTModel, and the scatter back. The engine itself is
checked against full-logit references in tests/test_engine_multirank.py (policy and SFT
losses train with these rows on every layout) and tests/test_varlen_attention.py."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from areal_mega.algo.policy_loss import reads_loss_mask_only
from areal_mega.engine.loss_rows import logits_at_rows, loss_rows, scatter_rows


def _marked():
    @reads_loss_mask_only
    def loss(lp, ent, mb):
        return lp.sum(), {}

    return loss


def test_rows_are_the_loss_mask_rows_that_have_a_label():
    mb = {"loss_mask": torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0])}
    valid = torch.tensor([True] * 4 + [False] + [True] * 4 + [False])
    rows = loss_rows(_marked(), mb, valid, None, sequence_parallel=False)
    assert rows.tolist() == [2, 3, 7, 8]
    # a context-parallel rank's share: its tokens are mb rows [1, 2, 7, 8, 9]
    idx = torch.tensor([1, 2, 7, 8, 9])
    assert loss_rows(
        _marked(), mb, torch.ones(5, dtype=torch.bool), idx, sequence_parallel=False
    ).tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "case", ["unmarked", "no_loss_fn", "sequence_parallel", "no_mask", "all_rows", "no_rows"]
)
def test_every_row_where_trimming_does_not_apply(case):
    mask = {"all_rows": [1, 1, 1], "no_rows": [0, 0, 0]}.get(case, [0, 1, 1])
    mb = {} if case == "no_mask" else {"loss_mask": torch.tensor(mask)}
    fn = {"unmarked": lambda lp, ent, mb: (lp.sum(), {}), "no_loss_fn": None}.get(case, _marked())
    assert (
        loss_rows(
            fn,
            mb,
            torch.ones(3, dtype=torch.bool),
            None,
            sequence_parallel=case == "sequence_parallel",
        )
        is None
    )


def test_the_processor_projects_the_rows_as_the_model_would():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 1, 4, generator=g, requires_grad=True)  # [s, b, h]
    weight = torch.randn(11, 4, generator=g, requires_grad=True)

    def output_layer(h, weight=None, runtime_gather_output=None):  # megatron's signature
        return F.linear(h, weight), None

    rows = torch.tensor([1, 4, 5])
    got = logits_at_rows(
        hidden_states=hidden,
        output_layer=output_layer,
        output_weight=weight,
        context=rows,
        runtime_gather_output=None,
        scale_logits=lambda x: 2 * x,
        config=None,
        labels=None,
    )
    full = (2 * F.linear(hidden, weight)).transpose(0, 1)  # the model's [b, s, V]
    assert got.shape == (1, 3, 11) and torch.equal(got, full[:, rows])
    gw = torch.autograd.grad(got.sum(), weight)[0]
    assert torch.allclose(gw, torch.autograd.grad(full[:, rows].sum(), weight)[0])


def test_the_processor_takes_what_megatron_passes():
    from megatron.core.models.gpt.gpt_model import GPTModel

    src = inspect.getsource(GPTModel._postprocess)
    call = src[src.index("return output_processor(") :]
    call = call[: call.index(")") + 1]
    passed = {
        a.split("=")[0].strip() for a in call.split("(", 1)[1].rstrip(")").split(",") if "=" in a
    }
    params = inspect.signature(logits_at_rows).parameters
    assert {"hidden_states", "output_layer", "output_weight", "context"} <= passed
    assert all(
        p in passed
        for p, v in params.items()
        if v.kind == v.KEYWORD_ONLY and v.default is inspect.Parameter.empty
    )


def test_scatter_back_is_differentiable_and_zero_elsewhere():
    v = torch.tensor([1.5, -2.0, 3.0], requires_grad=True)
    out = scatter_rows(v, torch.tensor([0, 3, 4]), 6)
    assert out.tolist() == [1.5, 0.0, 0.0, -2.0, 3.0, 0.0]
    (out * torch.arange(6.0)).sum().backward()
    assert v.grad.tolist() == [0.0, 3.0, 4.0]

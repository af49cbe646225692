"""The gradient relay (areal_mega/models/gradient_relay.py): a tensor one layer makes and later
layers read outside their inputs gets the same gradients under reentrant activation
checkpoints, chunk by chunk or several layers to a chunk, as when autograd sees the read
directly; a reader whose backward would come after its maker's is an error naming the key.
Gemma 4's use of it (key/value-shared layers and per-layer inputs under megatron's full
recompute) is checked against one rank without recompute in tests/test_new_families.py
(gemma4_text, ``tp2sp_recompute``)."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from areal_mega.models.gradient_relay import GradientRelay


class Toy(torch.nn.Module):
    """Layer 0 makes ``made`` beside its output; layers 1 and 2 read it from ``self.side``."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(6, 6, generator=g, dtype=torch.float64) * 0.5)
            for _ in range(4)
        )
        self.side: dict = {}
        self.relay = None

    def layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        if i == 0:
            made = torch.tanh(h @ self.w[3])
            self.side["made"] = made
            h = torch.tanh(h @ self.w[0])
            return self.relay.deliver(h, {"made": made}) if self.relay else h
        made = self.side["made"]
        if self.relay:
            made = self.relay.receive("made", made)
        return torch.tanh(h @ self.w[i]) * (1 + made) + made**2

    def chunk(self, start: int, end: int):
        def run(h):
            for i in range(start, end):
                h = self.layer(i, h)
            return h

        return run

    def forward(self, x, chunks=None):
        """``chunks``: (start, end) layer ranges each run under a reentrant checkpoint."""
        self.relay = GradientRelay() if chunks is not None else None
        h = x
        for start, end in chunks or [(0, 3)]:
            if chunks is None:
                h = self.chunk(start, end)(h)
            else:
                h = checkpoint(self.chunk(start, end), h, use_reentrant=True)
        return h


def grads(model, x, chunks):
    model.zero_grad()
    x = x.detach().requires_grad_()
    (model(x, chunks) ** 2).sum().backward()
    return [p.grad.clone() for p in model.w] + [x.grad.clone()]


@pytest.mark.parametrize(
    "chunks",
    [[(0, 1), (1, 2), (2, 3)], [(0, 2), (2, 3)], [(0, 1), (1, 3)], [(0, 3)]],
    ids=["per_layer", "maker_with_reader", "readers_together", "one_chunk"],
)
def test_checkpointed_readers_get_the_direct_gradients(chunks):
    model = Toy()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = grads(model, x, None)
    got = grads(model, x, chunks)
    for w, g in zip(want, got):
        assert torch.allclose(w, g, rtol=1e-12, atol=1e-12)
    # the maker's weight gets the readers' gradient: it is not zero
    assert want[3].abs().sum() > 0
    # nothing left in the mailbox, no leaf .grad kept
    assert model.relay._grads == {} and all(v == 0 for v in model.relay._pending.values())


def test_without_autograd_the_relay_only_passes_values_on():
    relay = GradientRelay()
    t = torch.ones(3, requires_grad=True) * 2
    with torch.no_grad():
        got = relay.receive("k", t)
        assert not got.requires_grad and torch.equal(got, t.detach())
        carrier = torch.zeros(3)
        assert relay.deliver(carrier, {"k": t}) is carrier
    assert relay._pending == {}


def test_a_reader_after_its_makers_backward_is_refused_naming_the_key():
    """The carrier is the loss's input itself: backward reaches the maker before the reader."""
    relay = GradientRelay()
    w = torch.ones(3, requires_grad=True)
    made = w * 2
    read = relay.receive(("full", "key"), made)
    out = relay.deliver((read * 3).sum(), {("full", "key"): made})
    with pytest.raises(RuntimeError, match=r"1 reader\(s\) of \('full', 'key'\) had not run"):
        out.backward()


def test_unread_made_tensors_get_no_gradient():
    relay = GradientRelay()
    w = torch.ones(3, requires_grad=True)
    made = w * 2
    relay.deliver(w.sum(), {"never_read": made}).backward()
    assert torch.equal(w.grad, torch.ones(3))

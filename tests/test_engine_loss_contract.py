"""The engine's loss contract, in one process: the loss function gets its micro-batch on the
compute device, and a CP rank's share with that share's own segment layout.

A CPU machine has a single real device, so the compute device here is PyTorch's ``meta``
device: the model side of the engine is replaced by a stand-in whose logprobs live on
``meta`` (the engine's ``_on_output`` itself, the production losses and ``loss_view`` run
unchanged). An engine that handed the loss its host-side micro-batch fails these tests, as it
failed the first GPU train step."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from areal_mega.algo import make_policy_loss
from areal_mega.config import AlgorithmConfig
from areal_mega.engine.loss_context import LAYOUT_KEYS, CPShard, loss_view
from areal_mega.engine.megatron_engine import MegatronEngine
from areal_mega.engine.packed import cp_token_index, shard_bounds
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train.batches import next_token_layout
from areal_mega.train.sft import sft_loss

META = torch.device("meta")


def _mb(lens=(9, 14, 5), cp=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lens:
        prox = -torch.rand(n, generator=g)
        seqs.append(
            {
                "input_ids": torch.randint(0, 50, (n,), generator=g),
                "prompt_len": max(1, n // 3),
                "advantages": torch.randn(n, generator=g),
                "prox_logprobs": prox,
                "logprobs": prox - 0.1,
                "ref_logprobs": prox + 0.1,
            }
        )
    seqs = [{**s, **next_token_layout(s["input_ids"])} for s in seqs]  # + labels, as trained
    mb = pack_sequences(seqs, pad_to_multiple=2 * cp if cp > 1 else 4, cp_size=cp)
    mb["policy_version"] = 0
    return mb


class _ModelSide:
    """The engine's model pieces on the ``meta`` device: logprobs and entropy derived
    (differentiably) from the model output; no CP."""

    mesh = SimpleNamespace(dims=SimpleNamespace(cp=1))

    def _token_logprobs(self, output, batch, temperature, return_entropy):
        lp = output.sum(-1).reshape(-1)
        return lp, lp.exp()


LOSSES = {
    "policy_token_mean": make_policy_loss(AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01))[0],
    "policy_gspo_seq_mean": make_policy_loss(
        dataclasses.replace(
            AlgorithmConfig(),
            ratio_level="sequence",
            imp_weight_level="geometric",
            loss_agg="seq_mean",
        )
    )[0],
    "sft": sft_loss,
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_output_hands_the_loss_its_micro_batch_on_the_compute_device(name):
    mb = _mb()
    total = mb["input_ids"].numel()
    seen = {}

    def recording(lp, ent, view):  # records what the production loss receives
        seen.update({k: v.device for k, v in view.items() if isinstance(v, torch.Tensor)})
        return LOSSES[name](lp, ent, view)

    batch = {"index": None, "valid": torch.ones(total, dtype=torch.bool, device=META)}
    output = torch.zeros(1, total, 8, device=META, requires_grad=True)
    loss, n_tok, stats = MegatronEngine._on_output(
        _ModelSide(), mb, batch, False, 1.0, True, recording, torch.tensor(3.0, device=META), output
    )
    assert loss.device == META and loss.requires_grad
    assert {k for k, d in seen.items() if d != META} == set(LAYOUT_KEYS)
    assert all(seen[k].type == "cpu" for k in LAYOUT_KEYS)  # host-side layout metadata
    assert "loss" in stats and all(v.device == META for v in stats.values())
    loss.backward()
    assert output.grad is not None and output.grad.device == META


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_losses_reject_inputs_on_another_device(name):
    mb = _mb()
    lp = torch.zeros(mb["input_ids"].numel(), device=META)
    with pytest.raises(ValueError, match="'loss_mask' is on cpu but logprobs are on meta"):
        LOSSES[name](lp, None, mb)
    view = loss_view(mb, META)
    with pytest.raises(ValueError, match="'entropy' is on cpu"):
        LOSSES[name](lp, torch.zeros(lp.shape), view)


@pytest.mark.parametrize("cp", [2, 3])
def test_shard_bounds_are_the_layout_of_the_zigzag_share(cp):
    mb = _mb(lens=(9, 14, 5, 1, 6), cp=cp)
    bounds = mb["cu_seqlens_padded"].tolist()
    seg = mb["segment_ids"].long()
    local = shard_bounds(bounds, cp)
    for rank in range(cp):
        idx = cp_token_index(mb, cp, rank)
        for b in range(len(bounds) - 1):
            mine = seg[idx][local[b] : local[b + 1]]
            assert mine.numel() == (bounds[b + 1] - bounds[b]) // cp and (mine == b).all()
        assert (seg[idx][local[-1] :] == len(bounds) - 1).all()  # trailing padding
    with pytest.raises(ValueError, match="cp_size"):
        shard_bounds([0, 3], 2)


def test_loss_view_of_a_cp_share():
    mb = _mb(cp=2)
    idx = cp_token_index(mb, 2, 1)
    view = loss_view(mb, torch.device("cpu"), idx, CPShard(None, 2, 1))
    assert view["cu_seqlens"].tolist() == shard_bounds(mb["cu_seqlens_padded"].tolist(), 2)
    assert torch.equal(view["advantages"], mb["advantages"][idx])
    assert torch.equal(view["seqlens"], mb["seqlens"]) and view["policy_version"] == 0
    assert view["cp_shard"].size == 2 and not view["cp_shard"].owner
    assert loss_view(mb, torch.device("cpu"))["cp_shard"] is None

"""What Gemma 4's pipeline stages pass each other (areal_mega/models/gemma4_pipeline.py): the
list of tensors in flight at each layer boundary, and a send / receive round trip (values and
gradients) with and without sequence parallelism's whole-sequence keys / values. PP2 end to end
(logprobs and gradients equal one rank) is gemma4_text's pp2 in tests/test_new_families.py."""

import pytest
import torch

from areal_mega.models import gemma4_pipeline as pipeline
from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf
from areal_mega.models.gemma3 import FULL, SLIDING
from areal_mega.models.gemma4_forward_state import PER_LAYER_INPUTS, Gemma4ForwardState
from tests.test_bridge_provider import GEMMA4 as BRIDGE_GEMMA4

S_KEY, S_VALUE, F_KEY, F_VALUE = (
    (SLIDING, "key"),
    (SLIDING, "value"),
    (FULL, "key"),
    (FULL, "value"),
)
PLI = PER_LAYER_INPUTS

# test_bridge_provider's Gemma 4 config with 6 layers, sliding / full alternating: layers 5
# and 6 read the keys / values of 3 and 4; per-layer inputs of width 4
GEMMA4 = dict(
    BRIDGE_GEMMA4,
    num_hidden_layers=6,
    layer_types=[SLIDING, FULL] * 3,
    hidden_size_per_layer_input=4,
)


def config(tp=1, **overrides):
    return transformer_config_from_hf(parse_hf_config(dict(GEMMA4, **overrides)), tp=tp)


@pytest.mark.parametrize(
    "after, want",
    [
        (0, []),  # nothing before the first layer
        (1, [PLI]),  # no source yet
        (2, [PLI]),
        (3, [S_KEY, S_VALUE, PLI]),  # the sliding source (3) done, the full one (4) not
        (4, [S_KEY, S_VALUE, F_KEY, F_VALUE, PLI]),
        (5, [F_KEY, F_VALUE, PLI]),  # the sliding reader (5) done
        (6, []),  # the model's end
    ],
)
def test_what_is_in_flight_after_each_layer(after, want):
    got = pipeline.in_flight(config(), after, tp=1)
    assert [key for key, _, _ in got] == want
    shapes = {key: (shape, whole) for key, shape, whole in got}
    if S_KEY in shapes:  # head_dim 8, 2 KV heads; the whole sequence
        assert shapes[S_KEY] == ((2, 8), True)
    if F_KEY in shapes:  # without K = V the full layers take num_key_value_heads
        assert shapes[F_KEY] == ((2, 16), True)
    if PLI in shapes:  # sequence-sharded like the hidden state
        assert shapes[PLI] == ((6, 4), False)


def test_heads_per_rank_and_models_without_either():
    assert pipeline.in_flight(config(tp=2), 4, tp=2)[0][1] == (1, 8)
    k_eq_v = config(attention_k_eq_v=True, num_global_key_value_heads=2)
    assert dict((k, s) for k, s, _ in pipeline.in_flight(k_eq_v, 4, tp=1))[F_KEY] == (2, 16)
    neither = config(num_kv_shared_layers=0, hidden_size_per_layer_input=0)
    assert all(pipeline.in_flight(neither, after, tp=1) == [] for after in range(7))
    no_pli = config(hidden_size_per_layer_input=0)
    assert [k for k, _, _ in pipeline.in_flight(no_pli, 2, tp=1)] == []


@pytest.mark.parametrize("seq_factor", [1, 2], ids=["no_sp", "sp2"])
def test_send_then_receive_gives_back_every_tensor_and_its_gradient(seq_factor):
    """Under SP a rank's hidden state holds s / tp tokens, its keys / values all s."""
    cfg = config()
    items = pipeline.in_flight(cfg, 4, tp=1)
    g = torch.Generator().manual_seed(0)
    s, b, h = 5, 1, cfg.hidden_size

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    sender = Gemma4ForwardState()
    hidden = rand(s, b, h)
    sender.per_layer_inputs = rand(s, b, 6, 4)
    made = {S_KEY: rand(s * seq_factor, b, 2, 8), S_VALUE: rand(s * seq_factor, b, 2, 8)}
    made |= {F_KEY: rand(s * seq_factor, b, 2, 16), F_VALUE: rand(s * seq_factor, b, 2, 16)}
    # a source layer's key is a view of its fused projection: not contiguous
    made[S_KEY] = made[S_KEY].transpose(0, 1).contiguous().transpose(0, 1)
    sender.kv.update({SLIDING: (made[S_KEY], made[S_VALUE]), FULL: (made[F_KEY], made[F_VALUE])})
    wide = pipeline.send(hidden, sender, items)
    assert wide.shape == (s, b, h + seq_factor * 2 * (16 + 32) + 24)

    receiver = Gemma4ForwardState()
    got_hidden = pipeline.receive(wide, h, receiver, items, seq_factor)
    got = {PLI: receiver.per_layer_inputs}
    got |= {S_KEY: receiver.kv[SLIDING][0], S_VALUE: receiver.kv[SLIDING][1]}
    got |= {F_KEY: receiver.kv[FULL][0], F_VALUE: receiver.kv[FULL][1]}
    assert torch.equal(got_hidden, hidden)
    assert torch.equal(got[PLI], sender.per_layer_inputs)
    for key, tensor in made.items():
        assert torch.equal(got[key], tensor), key
    # the gradient of every received tensor reaches its source
    weights = {
        key: torch.randn(t.shape, generator=g, dtype=torch.float64) for key, t in got.items()
    }
    loss = (got_hidden * 3).sum() + sum((got[k] * w).sum() for k, w in weights.items())
    loss.backward()
    assert torch.equal(hidden.grad, torch.full_like(hidden, 3.0))
    assert torch.equal(sender.per_layer_inputs.grad, weights[PLI])
    for key in (S_VALUE, F_KEY, F_VALUE):
        assert torch.equal(made[key].grad, weights[key]), key


def test_nothing_in_flight_sends_the_hidden_state_itself_and_a_wrong_width_is_named():
    hidden = torch.zeros(3, 1, 32)
    assert pipeline.send(hidden, Gemma4ForwardState(), []) is hidden
    items = pipeline.in_flight(config(), 1, tp=1)  # the per-layer inputs: 24 channels
    with pytest.raises(RuntimeError, match="sent 40 channels per token, this stage expects 56"):
        pipeline.receive(torch.zeros(3, 1, 40), 32, Gemma4ForwardState(), items, 1)

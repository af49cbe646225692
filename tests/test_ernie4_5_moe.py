"""Ernie 4.5 MoE's pieces against transformers (areal_mega/models/ernie4_5_moe.py): the routing
(softmax scores, the expert bias for the choice, the chosen scores renormalised by
max(sum, moe_norm_min)) and the dense / MoE layer rule; route capture and routing replay,
which cover bias-free softmax routers only, refuse it. The engine's numerics on every layout
are tests/test_new_families.py's."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Ernie4_5_MoeConfig
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
    Ernie4_5_MoeSparseMoeBlock,
    Ernie4_5_MoeTopKRouter,
)

from areal_mega.models.ernie4_5_moe import ernie_moe_layer_pattern, ernie_routing
from areal_mega.models.tiny import make_tiny_model


def _config(**kw):
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=22,
        moe_num_experts=8,
        moe_k=3,
        moe_intermediate_size=16,
    )
    return Ernie4_5_MoeConfig(**{**base, **kw})


@pytest.mark.parametrize("norm_min", [1e-12, 0.9])
def test_routing_is_transformers(norm_min):
    """The same experts and weights as transformers' router, with a bias that changes the
    choice of most tokens; with moe_norm_min 0.9 the floor of the renormalisation bites for
    tokens whose chosen scores sum to less."""
    torch.manual_seed(0)
    router = Ernie4_5_MoeTopKRouter(_config(moe_norm_min=norm_min))
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        router.moe_statics.e_score_correction_bias.normal_(0.0, 0.2)
    x = torch.randn(64, 32)
    logits, want_ids, want_w = router(x)
    probs, routing_map = ernie_routing(
        logits, 3, router.moe_statics.e_score_correction_bias[0], norm_min
    )
    assert torch.equal(routing_map.sum(-1), torch.full((64,), 3))
    assert torch.equal(routing_map.nonzero()[:, 1].view(64, 3), want_ids.sort(-1).values)
    assert (probs.gather(1, want_ids) - want_w).abs().max() < 1e-7
    unbiased = torch.topk(torch.softmax(logits, -1), 3, -1).indices.sort(-1).values
    assert (unbiased != want_ids.sort(-1).values).any(-1).float().mean() > 0.5
    sums = torch.softmax(logits, -1).gather(1, want_ids).sum(-1)
    assert ((sums < norm_min) == (probs.sum(-1) < 1 - 1e-6)).all()
    if norm_min == 0.9:
        assert (sums < norm_min).any()


@pytest.mark.parametrize(
    "start,end,interval", [(1, -1, 1), (0, -1, 2), (1, 4, 2), (2, 3, 1), (0, 5, 3)]
)
def test_layer_pattern_is_transformers(start, end, interval):
    cfg = _config(
        num_hidden_layers=6,
        moe_layer_start_index=start,
        moe_layer_end_index=end,
        moe_layer_interval=interval,
        moe_num_experts=2,
        moe_k=1,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    layers = model.model.layers
    want = tuple(int(isinstance(layer.mlp, Ernie4_5_MoeSparseMoeBlock)) for layer in layers)
    hf = dict(moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval)
    assert ernie_moe_layer_pattern(hf, 6) == want
    # as transformers saves it (end -1 written as the last layer's index)
    assert ernie_moe_layer_pattern(cfg.to_dict(), 6) == want


def test_route_capture_and_routing_replay_are_refused(tmp_path):
    """The servers' route capture recomputes a bias-free softmax top-k: an Ernie server with
    --enable-return-routed-experts and an Ernie actor with routing replay are refused."""
    from areal_mega.engine.routing_replay import check_replay_target
    from areal_mega.inference.route_capture import RouteCapture
    from areal_mega.models.builder import parse_hf_config

    d = make_tiny_model(tmp_path / "m", arch="ernie4_5_moe", hidden_size=32, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(d)
    with pytest.raises(ValueError, match=r"expert bias \(layers \[1\]\)"):
        RouteCapture(model)
    arch = parse_hf_config(model.config.to_dict())
    assert arch.moe_score_function == "softmax" and arch.moe_expert_bias
    with pytest.raises(ValueError, match="expert bias.*routing_replay=off"):
        check_replay_target(True, "actor", arch)
    from areal_mega.config import ConfigError, config_from_dict
    from areal_mega.rollout.routes import replay_layout

    cfg = config_from_dict({"model": {"path": str(d)}, "algorithm": {"routing_replay": "r3"}})
    with pytest.raises(ConfigError, match="r3'.*'ernie4_5_moe' routes with an expert bias"):
        replay_layout(cfg)


def test_expert_bias_row_and_mtp_tensors_in_conversion(tmp_path):
    """The expert bias is HF [1, experts] and megatron [experts] (table kind ``row``, both
    ways and streamed); the hub's multi-token-prediction modules (``mtp_*``, which transformers
    skips by name) are skipped by the converter, any other unknown tensor is still refused."""
    from safetensors.torch import load_file, save_file

    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.checkpoint.convert import convert_hf_to_mcore
    from areal_mega.checkpoint.hf_mapping_moe import is_mtp_tensor

    d = make_tiny_model(tmp_path / "m", arch="ernie4_5_moe", hidden_size=32, num_layers=2)
    arch = hm.read_arch(d)
    names, kind = hm.hf_names_for(arch, 1, None, "mlp.router.expert_bias")
    assert names == ("model.layers.1.mlp.moe_statics.e_score_correction_bias",)
    assert kind == "row"
    hf = torch.randn(1, 4)
    mc = hm.to_mcore(arch, kind, [hf])
    assert mc.shape == (4,) and torch.equal(mc, hf[0])
    assert torch.equal(hm.to_hf(arch, kind, mc)[0], hf)
    assert torch.equal(torch.cat(hm.to_hf_segments(arch, kind, mc)[0]), hf)
    streamed = hm.to_mcore_segments(arch, kind, names, {names[0]: hf}.get)
    assert torch.equal(torch.cat(list(streamed)), mc)
    with pytest.raises(ValueError, match=r"\[1, n\]"):
        hm.to_mcore(arch, kind, [torch.randn(4)])
    assert is_mtp_tensor(arch, "model.mtp_block.0.self_attn.q_proj.weight")
    assert is_mtp_tensor(arch, "model.mtp_linear_proj.0.weight")
    assert not is_mtp_tensor(arch, "model.layers.1.mlp.gate.weight")

    (path,) = d.glob("*.safetensors")
    sd = load_file(str(path))
    mtp = {
        "model.mtp_block.0.mlp.up_proj.weight": torch.zeros(8, 32),
        "model.mtp_linear_proj.0.weight": torch.zeros(32, 64),
    }
    save_file(dict(sd, **mtp), str(path), metadata={"format": "pt"})
    convert_hf_to_mcore(d, tmp_path / "ok", progress=False)
    extra = {"model.layers.0.mlp.extra.weight": torch.zeros(2)}
    save_file(dict(sd, **extra), str(path), metadata={"format": "pt"})
    with pytest.raises(hm.UnsupportedModelError, match="unexpected tensor"):
        convert_hf_to_mcore(d, tmp_path / "bad", progress=False)

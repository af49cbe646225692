"""Weight updates of the CPU rollout server with HF checkpoint names on a transformers model
that stores its MoE experts fused (qwen3_moe): per-expert tensors land in the right slices,
a whole checkpoint loads to the same logits as ``from_pretrained``, and bad names, shapes and
missing experts are refused with the name; checkpoint names that transformers renames on load
(HY-V3, MiniMax-M2, Ernie 4.5 MoE) resolve through the same renamings."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from areal_mega.inference.http_api import BadRequest
from areal_mega.inference.param_targets import ParamTargets, checkpoint_renames
from areal_mega.inference.server_state import LocalRolloutServer
from areal_mega.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    a = make_tiny_model(
        d / "a",
        arch="qwen3_moe",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        num_experts=4,
        seed=1,
    )
    b = make_tiny_model(
        d / "b",
        arch="qwen3_moe",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        num_experts=4,
        seed=2,
    )
    return a, b


def test_per_expert_names_resolve_to_slices_of_the_fused_parameters(moe):
    model = AutoModelForCausalLM.from_pretrained(moe[0])
    sd = model.state_dict()
    t = ParamTargets(sd)
    fused = sd["model.layers.1.mlp.experts.gate_up_proj"]
    half = fused.shape[1] // 2
    assert t.target("model.layers.1.mlp.experts.3.up_proj.weight") == (
        "model.layers.1.mlp.experts.gate_up_proj",
        (3, slice(half, 2 * half)),
    )
    assert t.target("model.layers.1.mlp.experts.2.down_proj.weight") == (
        "model.layers.1.mlp.experts.down_proj",
        (2,),
    )
    assert t.target("model.norm.weight") == ("model.norm.weight", ())
    assert t.target("model.layers.1.mlp.experts.4.up_proj.weight") is None  # 4 experts
    assert t.target("model.layers.1.mlp.experts.0.w1.weight") is None
    ckpt = load_file(str(next(moe[0].glob("*.safetensors"))))
    assert t.missing(ckpt, dict(model.named_parameters())) == []
    some = {k: v for k, v in ckpt.items() if ".experts.1." not in k}
    assert t.missing(some, dict(model.named_parameters())) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.1.mlp.experts.gate_up_proj",
    ]


def test_the_server_loads_an_moe_checkpoint_by_its_hf_names(moe, tmp_path):
    a, b = moe
    srv = LocalRolloutServer(str(a))
    try:
        ids = torch.tensor([[3, 5, 7, 9, 11]])
        ref = AutoModelForCausalLM.from_pretrained(b).eval()
        with torch.no_grad():
            want = ref(ids).logits
            assert not torch.allclose(srv.model(ids).logits, want)
        srv.load_from_disk(str(b), "1")
        with torch.no_grad():
            got = srv.model(ids).logits
        assert (got - want).abs().max() < 1e-6, (got - want).abs().max()
        assert srv.engine.weight_version == "1"
        ckpt = load_file(str(next(b.glob("*.safetensors"))))
        bad = tmp_path / "bad"
        bad.mkdir()
        wrong = dict(ckpt)
        wrong["model.layers.0.mlp.experts.1.gate_proj.weight"] = torch.zeros(3, 3)
        save_file(wrong, str(bad / "model.safetensors"))
        with pytest.raises(BadRequest, match=r"experts\.1\.gate_proj\.weight: got \[3, 3\]"):
            srv.load_from_disk(str(bad), "2")
        save_file(
            {k: v for k, v in ckpt.items() if ".experts.2.down" not in k},
            str(bad / "model.safetensors"),
        )
        with pytest.raises(BadRequest, match="missing parameter.*experts.down_proj"):
            srv.load_from_disk(str(bad), "2")
    finally:
        srv.engine.shutdown()


def test_hub_names_that_transformers_renames_resolve_to_the_model(tmp_path):
    """HY-V3 checkpoints name the router, the expert bias and the shared experts otherwise than
    the modules (transformers renames them on load): a checkpoint loads into a server model
    through the same renamings, to ``from_pretrained``'s logits."""
    a = make_tiny_model(tmp_path / "a", arch="hy_v3", hidden_size=32, num_layers=2, seed=1)
    b = make_tiny_model(tmp_path / "b", arch="hy_v3", hidden_size=32, num_layers=2, seed=2)
    ckpt = load_file(str(next(b.glob("*.safetensors"))))
    assert {"model.layers.1.mlp.expert_bias", "model.layers.1.mlp.router.gate.weight"} <= set(ckpt)
    model = AutoModelForCausalLM.from_pretrained(a)
    sd = model.state_dict()
    assert ParamTargets(sd).target("model.layers.1.mlp.expert_bias") is None
    t = ParamTargets(sd, checkpoint_renames("hy_v3"))
    assert t.target("model.layers.1.mlp.expert_bias") == (
        "model.layers.1.mlp.e_score_correction_bias",
        (),
    )
    assert t.target("model.layers.1.mlp.shared_mlp.up_proj.weight") == (
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        (),
    )
    assert [n for n in ckpt if t.target(n) is None] == []
    assert t.missing(ckpt, dict(model.named_parameters())) == []
    assert checkpoint_renames("llama") == ()
    _loads_to_the_logits_of(a, b)


def test_per_expert_names_of_another_spelling_resolve_to_the_fused_experts(tmp_path):
    """MiniMax-M2 checkpoints keep ``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``, which
    transformers renames and fuses into ``mlp.experts.gate_up_proj`` / ``down_proj``: the
    checkpoint loads into a server model to ``from_pretrained``'s logits."""
    kw = dict(arch="minimax_m2", hidden_size=32, num_layers=2, head_dim=16)
    a = make_tiny_model(tmp_path / "a", seed=1, **kw)
    b = make_tiny_model(tmp_path / "b", seed=2, **kw)
    ckpt = load_file(str(next(b.glob("*.safetensors"))))
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in ckpt
    model = AutoModelForCausalLM.from_pretrained(a)
    t = ParamTargets(model.state_dict(), checkpoint_renames("minimax_m2"))
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    half = model.state_dict()[fused].shape[1] // 2
    assert t.target("model.layers.0.block_sparse_moe.experts.1.w3.weight") == (
        fused,
        (1, slice(half, 2 * half)),
    )
    assert t.target("model.layers.0.block_sparse_moe.experts.1.w2.weight") == (
        "model.layers.0.mlp.experts.down_proj",
        (1,),
    )
    assert [n for n in ckpt if t.target(n) is None] == []
    assert t.missing(ckpt, dict(model.named_parameters())) == []
    _loads_to_the_logits_of(a, b)


def test_ernie_expert_bias_of_the_hub_resolves_into_the_gate(tmp_path):
    """Ernie 4.5 MoE checkpoints keep the expert bias as ``mlp.moe_statics.
    e_score_correction_bias`` ([1, experts]; transformers' router holds it as
    ``mlp.gate.moe_statics``) and per-expert gate / up / down: the checkpoint loads into a
    server model to ``from_pretrained``'s logits (the bias chooses experts there)."""
    kw = dict(arch="ernie4_5_moe", hidden_size=32, num_layers=2, expert_bias_std=0.05)
    a = make_tiny_model(tmp_path / "a", seed=1, **kw)
    b = make_tiny_model(tmp_path / "b", seed=2, **kw)
    ckpt = load_file(str(next(b.glob("*.safetensors"))))
    hub = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    assert tuple(ckpt[hub].shape) == (1, 4) and ckpt[hub].abs().min() > 0
    model = AutoModelForCausalLM.from_pretrained(a)
    t = ParamTargets(model.state_dict(), checkpoint_renames("ernie4_5_moe"))
    assert t.target(hub) == ("model.layers.1.mlp.gate.moe_statics.e_score_correction_bias", ())
    assert t.target("model.layers.1.mlp.experts.2.up_proj.weight")[0] == (
        "model.layers.1.mlp.experts.gate_up_proj"
    )
    assert [n for n in ckpt if t.target(n) is None] == []
    assert t.missing(ckpt, dict(model.named_parameters())) == []
    _loads_to_the_logits_of(a, b)


def _loads_to_the_logits_of(a, b):
    """A server on model ``a`` that loads checkpoint ``b`` from disk gives ``b``'s
    ``from_pretrained`` logits."""
    srv = LocalRolloutServer(str(a))
    try:
        ids = torch.tensor([[3, 5, 7, 9, 11]])
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(b).eval()(ids).logits
        srv.load_from_disk(str(b), "1")
        with torch.no_grad():
            got = srv.model(ids).logits
        assert (got - want).abs().max() < 1e-6, (got - want).abs().max()
    finally:
        srv.engine.shutdown()

"""LoRA's pure parts and its checks before any work: target names, unsupported settings, the
config section, and two upstream behaviours of Megatron-Bridge we work around (these tests fail
when an upstream release makes the workaround unnecessary)."""

import json
import types

import pytest
import torch

from areal_mega.config import ConfigError, load_config
from areal_mega.lora.targets import (
    LoraSupportError,
    canonical_targets,
    check_lora_support,
    hf_targets,
)
from areal_mega.train.weights import resolve_weight_update


def test_target_names_peft_canonical_and_all_linear():
    assert hf_targets(["v_proj", "q_proj", "linear_q"]) == ["q_proj", "v_proj"]
    assert hf_targets("all-linear") == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert canonical_targets(["o_proj", "linear_fc2"]) == ["linear_proj", "linear_fc2"]
    with pytest.raises(LoraSupportError, match="'qkv_proj' is not a linear"):
        hf_targets(["q_proj", "qkv_proj"])
    with pytest.raises(LoraSupportError, match="empty"):
        hf_targets([])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rank=0), "lora.rank=0: must be >= 1"),
        (dict(rank=6, tp=4), "multiple of TP"),
        (dict(is_mla=True), "multi-latent attention"),
        (dict(is_moe=True, targets=["q_proj", "gate_proj"]), r"MoE.*\['gate_proj'\]"),
        (dict(gated_mlp=False, targets=["q_proj", "up_proj"]), r"no gate.*\['up_proj'\]"),
        (dict(hybrid=True), "hybrid"),
        (
            dict(model_type="exaone4", targets=["q_proj", "o_proj", "down_proj"]),
            r"post-norm.*\['o_proj', 'down_proj'\]",
        ),
        # Gemma 2 / 3: the same post-norms inside linear_proj / linear_fc2 (gemma3.py)
        (dict(model_type="gemma3_text", targets=["o_proj"]), r"post-norm.*\['o_proj'\]"),
        (dict(model_type="gemma2", targets=["down_proj"]), r"post-norm.*\['down_proj'\]"),
        (dict(model_type="qwen3_next", linear_attention=True), "gated delta-net"),
        # Gemma 4: the fused QKV differs by layer (gemma4.py)
        (dict(model_type="gemma4_text"), "fused QKV differs by layer"),
        (dict(cp=2), "context parallel size 2"),
        (dict(critic=True), "critic"),
    ],
)
def test_unsupported_settings_are_refused_with_the_reason(kw, match):
    args = dict(
        model_type="qwen3", is_moe=False, is_mla=False, targets=["q_proj"], rank=8, tp=1, cp=1
    )
    with pytest.raises(LoraSupportError, match=match):
        check_lora_support(**{**args, **kw})


def test_moe_attention_only_and_tp_divisible_rank_are_fine():
    check_lora_support(
        model_type="qwen3_moe",
        is_moe=True,
        is_mla=False,
        targets=["q_proj", "o_proj"],
        rank=8,
        tp=2,
        cp=1,
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["lora.rank=0"], "lora.rank=0"),
        (["lora.target_modules=[q_proj,attn_out]"], "'attn_out'"),
        (["lora.sync=full"], "lora.sync"),
        (["allocation=local:d1+megatron:t2", "lora.rank=3"], "lora.rank=3 with tensor parallel"),
        (["ref.enabled=true", "ref.path=/elsewhere"], "ref.path='/elsewhere' with lora.enabled"),
        (["critic.enabled=true", "algorithm.adv_estimator=gae"], "critic"),
        (["rollout.weight_update=distributed"], "weight_update='distributed' with lora"),
    ],
)
def test_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["lora.enabled=true"] + overrides)


def test_config_checks_the_model_family(tmp_path):
    from areal_mega.config import check_against_model

    for name, hf in (
        ("moe", {"model_type": "qwen3_moe", "num_experts": 4}),
        ("ernie", {"model_type": "ernie4_5_moe", "moe_num_experts": 4}),
        ("mla", {"model_type": "deepseek_v3", "kv_lora_rank": 32}),
        ("gdn", {"model_type": "qwen3_5_text", "layer_types": ["linear_attention"]}),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 4096}))
        cfg = load_config(None, ["lora.enabled=true", f"model.path={d}"])
        with pytest.raises(ConfigError, match=str(d)):
            check_against_model(cfg)
    ok = load_config(
        None,
        [
            "lora.enabled=true",
            f"model.path={tmp_path / 'moe'}",
            "lora.target_modules=[q_proj,v_proj]",
        ],
    )
    check_against_model(ok)


def test_peft_tensors_without_a_place_in_the_model_are_named():
    from areal_mega.lora.peft_io import _unexpected

    pre = "base_model.model.model.layers"
    names = dict.fromkeys(
        [
            f"{pre}.0.self_attn.q_proj.lora_A.weight",
            f"{pre}.1.self_attn.q_proj.lora_B.weight",
            f"{pre}.1.mlp.down_proj.lora_B.weight",
            f"{pre}.7.self_attn.q_proj.lora_B.weight",
            "base_model.model.lm_head.lora_A.weight",
        ],
        0,
    )
    assert _unexpected(names, {"q_proj"}, num_layers=2) == [
        "base_model.model.lm_head.lora_A.weight",
        f"{pre}.1.mlp.down_proj.lora_B.weight",
        f"{pre}.7.self_attn.q_proj.lora_B.weight",
    ]
    assert _unexpected({}, {"q_proj"}, num_layers=2) == []


def test_lora_publishes_files():
    assert resolve_weight_update("auto", cuda=True, pp=1, lora=True) == "disk"
    with pytest.raises(ValueError, match="distributed' with lora.enabled"):
        resolve_weight_update("distributed", cuda=True, pp=1, lora=True)


def test_bridge_peft_still_believes_te_is_present_without_it():
    """Megatron-Bridge computes its PEFT ``HAVE_TE`` from megatron-core's TE wrapper names,
    which exist without TE: we set it False (``settle_bridge_peft_te_flags``). When this test
    fails, upstream computes the flag right and the workaround can go."""
    from areal_mega.compat.te_placeholder import te_importable
    from areal_mega.lora.layers import import_canonical_lora

    if te_importable():
        pytest.skip("TransformerEngine is installed")
    import_canonical_lora()
    import megatron.bridge.peft.utils as u

    upstream = all(
        (u.HAVE_TE_COL_LINEAR, u.HAVE_TE_LN_COL_LINEAR, u.HAVE_TE_ROW_LINEAR, u.HAVE_TE_LINEAR)
    )
    assert upstream, "upstream's HAVE_TE is right without TE now: drop the workaround"
    assert u.HAVE_TE is False


def test_bridge_split_qkv_fails_on_a_token_count_not_a_multiple_of_tp():
    """The bridge's canonical ``linear_qkv`` wrapper reshapes a TP shard's q/k/v adapter outputs
    with the *global* head counts: it only works when the token count is a multiple of TP
    (then TP tokens share a reshaped row), and fails otherwise. :class:`SplitQKVLoRA` uses the
    shard's own counts. When this test fails, upstream handles it and ours can go."""
    from areal_mega.lora.layers import import_canonical_lora

    import_canonical_lora()
    from megatron.bridge.peft.canonical_lora import LoRALinearSplitQKV

    cfg = types.SimpleNamespace(
        num_attention_heads=4, num_query_groups=2, kv_channels=8, hidden_size=32
    )
    fake = types.SimpleNamespace(to_wrap=types.SimpleNamespace(config=cfg))
    hd = 8  # one TP2 shard: 2 query heads and 1 group per rank

    def shard(s):
        return (
            torch.randn(s, 1, 2 * hd),
            torch.randn(s, 1, hd),  # noqa: E731
            torch.randn(s, 1, hd),
        )

    q, k, v = shard(4)
    assert torch.equal(
        LoRALinearSplitQKV._interleave_qkv(fake, q, k, v), torch.cat([q, k, v], dim=-1)
    )  # 4 tokens: right by accident
    with pytest.raises(RuntimeError, match="invalid for input"):
        LoRALinearSplitQKV._interleave_qkv(fake, *shard(3))  # 3 tokens on TP2

import pytest

from areal_mega.config import ConfigError, load_config, parse_overrides
from areal_mega.parallel.allocation import AllocationError, parse_allocation


def test_defaults_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optimizer:\n  lr: 1.0e-5\nrollout:\n  n_samples: 4\n")
    cfg = load_config(
        recipe,
        ["optimizer.lr=2e-6", "allocation=sglang:d2+megatron:t2p2", "rollout.server_addrs=a:1,b:2"],
    )
    assert cfg.optimizer.lr == 2e-6
    assert cfg.rollout.n_samples == 4
    assert cfg.allocation == "sglang:d2+megatron:t2p2"
    assert cfg.rollout.server_addrs == ["a:1", "b:2"]
    assert isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    "override, words",
    [
        (["optimizer.lrr=1"], ["optimizer.lrr", "unknown key", "lr"]),
        (["nosuch.key=1"], ["nosuch", "unknown key"]),
        (["optimizer.lr=abc"], ["optimizer.lr", "'abc'", "float"]),
        (["optimizer.lr=-1"], ["optimizer.lr", ">= 0"]),
        (["model.dtype=fp8"], ["model.dtype", "fp8", "one of"]),
        (["rollout.top_p=0"], ["rollout.top_p", "> 0"]),
        (["allocation=sglang:d2+megatron:t2e3"], ["allocation", "'e'", "divide"]),
        (["algorithm.kl_coef=0.1"], ["algorithm.kl_coef", "ref.enabled"]),
        (["optimizer.lr=1e-6", "optimizer.min_lr=1e-3"], ["optimizer.min_lr"]),
        (["seed"], ["key=value"]),
        (
            ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1", "ref.enabled=true"],
            ["algorithm.kl_in_reward", "loss term"],
        ),
        (["algorithm.adv_estimator=gae"], ["algorithm.adv_estimator", "critic"]),
    ],
)
def test_bad_config_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_parse_overrides_nested():
    assert parse_overrides(["a.b.c=1", "a.d=x", "e=[1, 2]"]) == {
        "a": {"b": {"c": 1}, "d": "x"},
        "e": [1, 2],
    }


@pytest.mark.parametrize(
    "text, trainer, rollout, tw, rw",
    [
        ("sglang:d4t2+megatron:d2p2t2c1e2", "d2t2p2c1e2", "d4t2p1c1e1", 8, 8),
        ("local:d1+megatron:t2", "d1t2p1c1e1", "d1t1p1c1e1", 2, 1),
        ("megatron:t2p2", "d1t2p2c1e1", None, 4, 0),
        ("sglang:d1+megatron:d2c2e4", "d2t1p1c2e4", "d1t1p1c1e1", 4, 1),
        # MoE parallel folding: the experts' own TP (AReaL's hybrid form)
        ("megatron:(attn:t2|ffn:t1)", "(attn:d1t2p1c1|ffn:d2t1p1e1)", None, 2, 0),
        (
            "local:d1+megatron:(attn:d2t2|ffn:t1e4)",
            "(attn:d2t2p1c1|ffn:d1t1p1e4)",
            "d1t1p1c1e1",
            4,
            1,
        ),
        ("megatron:(attn:d2t2p2|ffn:d1t1p2e4)", "(attn:d2t2p2c1|ffn:d1t1p2e4)", None, 8, 0),
        ("megatron:(attn:d1t2c2|ffn:t1e2)", "(attn:d1t2p1c2|ffn:d2t1p1e2)", None, 4, 0),
        # the experts at attention's TP: the plain form (one spelling per layout)
        ("megatron:(attn:d2t2|ffn:t2e2)", "d2t2p1c1e2", None, 4, 0),
    ],
)
def test_allocation_ok(text, trainer, rollout, tw, rw):
    a = parse_allocation(text)
    assert a.trainer.short() == trainer
    assert (a.rollout.short() if a.rollout else None) == rollout
    assert a.trainer_world_size == tw and a.rollout_world_size == rw
    # what messages print parses back
    assert parse_allocation(f"megatron:{a.trainer.short()}").trainer == a.trainer


def test_allocation_expert_sizes():
    """The experts' TP, and their data-parallel size over a stage's d·t·c ranks."""
    folded = parse_allocation("megatron:(attn:d2t2|ffn:t1e2)").trainer
    assert (folded.tp, folded.expert_tp, folded.ep, folded.expert_dp) == (2, 1, 2, 2)
    plain = parse_allocation("megatron:d4t2e2").trainer
    assert (plain.etp, plain.expert_tp, plain.expert_dp) == (None, 2, 2)


@pytest.mark.parametrize(
    "text, words",
    [
        ("", ["empty"]),
        ("sglang:d2", ["trainer", "sglang"]),
        ("tgi:d2+megatron:t2", ["rollout backend", "tgi"]),
        ("sglang:d2+megatron:t2x2", ["unknown letter 'x'"]),
        ("sglang:d2+megatron:t2t2", ["'t' given twice"]),
        ("sglang:d2+megatron:t0", ["'t'", ">= 1"]),
        ("sglang:c2+megatron:t2", ["'c'", "not allowed"]),
        ("sglang:d2+megatron:d3e2", ["'e'", "divide", "3"]),
        ("sglang:d2+megatron:", ["no dimensions"]),
        ("sglang:d2+megatron:2t", ["cannot parse"]),
        ("a:d1+b:d1+c:d1", ["at most two"]),
        ("megatron", ["<backend>:<dims>"]),
        ("megatron:(attn:t2)", ["both 'attn:<dims>' and 'ffn:<dims>'"]),
        ("megatron:(attn:t2|moe:t1)", ["'attn:<dims>|ffn:<dims>'", "moe:t1"]),
        ("megatron:(attn:t2|attn:t2)", ["'attn' given twice"]),
        ("megatron:(attn:t2e2|ffn:t1)", ["'e'", "not allowed", "d, t, p, c"]),
        ("megatron:(attn:t2|ffn:c2)", ["'c'", "not allowed", "d, t, p, e"]),
        ("megatron:(attn:t2p2|ffn:t1p1)", ["ffn's 'p' (1)", "attn's (2)"]),
        ("megatron:(attn:d2t2|ffn:t1e3)", ["t·e = 1·3 = 3", "d·t·c = 2·2·1 = 4"]),
        ("megatron:(attn:d2t2|ffn:d2t1)", ["world", "2·1·1·1 = 2", "d·t·p·c = 4"]),
    ],
)
def test_allocation_errors(text, words):
    with pytest.raises(AllocationError) as e:
        parse_allocation(text)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize(
    "name", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk", "opo"]
)
def test_verl_estimators_are_choices(name):
    cfg = load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n_samples=4"])
    assert cfg.algorithm.adv_estimator == name
    if name == "reinforce_plus_plus":  # no groups: one sample per prompt is fine
        assert (
            load_config(
                None, [f"algorithm.adv_estimator={name}", "rollout.n_samples=1"]
            ).rollout.n_samples
            == 1
        )
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n_samples=1"])
    assert "rollout.n_samples" in str(e.value) and name in str(e.value)

"""``rollout.backend: vllm`` in the config: the ``rollout.vllm`` section, the refusals that name
their key, the allocation prefix ``vllm:`` and the weight-update group of vLLM servers."""

from pathlib import Path

import pytest

from areal_mega.config import MANAGED_VLLM_FLAGS, ConfigError, config_to_dict, load_config
from areal_mega.parallel.allocation import AllocationError, parse_allocation
from areal_mega.parallel.weight_group import WeightGroup, weight_update_group

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-cpu.yaml"
VLLM = ["rollout.backend=vllm", "allocation=vllm:d1+megatron:d1"]


def test_defaults_and_overrides():
    cfg = load_config(TINY, VLLM)
    v = cfg.rollout.vllm
    assert cfg.rollout.backend == "vllm"
    assert (v.python, v.kv_cache_gib, v.enforce_eager, v.max_model_len) == ("", 1.0, True, 0)
    assert v.gpu_memory_utilization is None and v.extra_args == []
    cfg = load_config(
        TINY,
        VLLM
        + [
            "rollout.vllm.python=/opt/v/bin/python",
            "rollout.vllm.kv_cache_gib=2",
            "rollout.vllm.enforce_eager=false",
            "rollout.vllm.max_model_len=512",
            "rollout.vllm.gpu_memory_utilization=0.6",
            "rollout.vllm.extra_args=[--max-num-seqs, 64]",
        ],
    )
    v = cfg.rollout.vllm
    assert (v.python, v.kv_cache_gib, v.enforce_eager, v.max_model_len) == (
        "/opt/v/bin/python",
        2.0,
        False,
        512,
    )
    assert v.gpu_memory_utilization == 0.6 and v.extra_args == ["--max-num-seqs", 64]
    assert config_to_dict(cfg)["rollout"]["vllm"]["max_model_len"] == 512


@pytest.mark.parametrize(
    "override, words",
    [
        (["rollout.backend=vllm2"], ["rollout.backend", "vllm"]),
        (["rollout.vllm.kv_cache_gib=0"], ["rollout.vllm.kv_cache_gib"]),
        (["rollout.vllm.max_model_len=-1"], ["rollout.vllm.max_model_len"]),
        (["rollout.vllm.gpu_memory_utilization=1.5"], ["rollout.vllm.gpu_memory_utilization"]),
        (["rollout.vllm.gpu_memory_utilization=0"], ["rollout.vllm.gpu_memory_utilization"]),
        (["rollout.vllm.no_such_key=1"], ["rollout.vllm.no_such_key"]),
    ],
)
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, VLLM + override)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_lora_is_refused_with_vllm():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, VLLM + ["lora.enabled=true", "rollout.weight_update=disk"])
    assert str(e.value).startswith(
        "rollout.backend=vllm: LoRA adapters are served only by sglang/local here"
    )
    # the same LoRA run on the CPU server is fine
    assert load_config(TINY, ["lora.enabled=true"]).lora.enabled


def test_routing_replay_is_refused_with_vllm():
    with pytest.raises(
        ConfigError,
        match=r"algorithm.routing_replay='r3' with "
        r"rollout.backend=vllm",
    ):
        load_config(TINY, VLLM + ["algorithm.routing_replay=r3"])


@pytest.mark.parametrize("override", [["rollout.top_p=0.9"], ["rollout.top_k=20"]])
def test_truncated_sampling_is_refused_in_rl(override):
    """vLLM's processed logprobs are renormalised after top-k/top-p; ours are not."""
    with pytest.raises(ConfigError, match="rollout.top_p=.*rollout.top_k=.*renormalisation"):
        load_config(TINY, VLLM + override)
    assert load_config(TINY, ["rollout.backend=vllm", "mode=sft", *override])  # no rollout
    assert load_config(TINY, override)  # local server
    assert load_config(TINY, VLLM + ["rollout.top_k=-1", "rollout.top_p=1"])


def test_kv_cache_is_whole_gib():
    with pytest.raises(ConfigError, match=r"rollout.vllm.kv_cache_gib=0.5: .*whole number"):
        load_config(TINY, VLLM + ["rollout.vllm.kv_cache_gib=0.5"])
    assert (
        load_config(TINY, VLLM + ["rollout.vllm.kv_cache_gib=3.0"]).rollout.vllm.kv_cache_gib == 3.0
    )


@pytest.mark.parametrize(
    "arg, flag",
    [
        ("--tensor-parallel-size", "--tensor-parallel-size"),
        ("-tp", "-tp"),
        ("--max_model_len=64", "--max-model-len"),
        ("--api-key", "--api-key"),
        ("--seed=3", "--seed"),
        ("--worker-extension-cls", "--worker-extension-cls"),
        ("--logprobs-mode", "--logprobs-mode"),
        ("--port", "--port"),
    ],
)
def test_extra_args_may_not_repeat_what_the_launcher_sets(arg, flag):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, VLLM + [f"rollout.vllm.extra_args=[{arg}]"])
    msg = str(e.value)
    assert msg.startswith("rollout.vllm.extra_args[0]=") and f"sets {flag} itself" in msg
    assert MANAGED_VLLM_FLAGS[flag] in msg


def test_extra_args_items_are_words():
    with pytest.raises(ConfigError, match=r"rollout.vllm.extra_args\[1\]=.*one command-line"):
        load_config(TINY, VLLM + ["rollout.vllm.extra_args=[--max-num-seqs, {a: 1}]"])
    cfg = load_config(
        TINY, VLLM + ["rollout.vllm.extra_args=[--max-num-seqs, 8, --middleware, x.Y]"]
    )
    assert cfg.rollout.vllm.extra_args == ["--max-num-seqs", 8, "--middleware", "x.Y"]


def test_vllm_section_is_ignored_by_the_other_backends():
    """Rules of the vLLM backend apply only to it (a recipe may keep its vllm section)."""
    cfg = load_config(TINY, ["rollout.vllm.extra_args=[--port]", "rollout.vllm.kv_cache_gib=0.5"])
    assert cfg.rollout.backend == "local"


def test_allocation_prefix_vllm():
    a = parse_allocation("vllm:d2t4+megatron:t2p2")
    assert a.rollout_backend == "vllm" and (a.rollout.dp, a.rollout.tp) == (2, 4)
    assert a.canonical() == "vllm:d2t4p1c1e1+megatron:d1t2p2c1e1"
    with pytest.raises(AllocationError, match="unknown rollout backend 'vllmx'.*vllm"):
        parse_allocation("vllmx:d1+megatron:d1")
    with pytest.raises(AllocationError, match="letter 'c'"):
        parse_allocation("vllm:d1c2+megatron:d1")
    with pytest.raises(ConfigError, match="allocation="):
        load_config(TINY, ["rollout.backend=vllm", "allocation=vllm:d0+megatron:d1"])


def test_weight_group_of_vllm_servers_is_sglangs():
    """Server i joins as ranks 1 + i·t .. (its tensor-parallel ranks), as SGLang's do."""
    for text in ("d1t1", "d2t4", "d3t2", "d4t1"):
        v = weight_update_group(parse_allocation(f"vllm:{text}+megatron:d1"), "vllm")
        s = weight_update_group(parse_allocation(f"sglang:{text}+megatron:d1"), "sglang")
        assert v == s
    assert weight_update_group(parse_allocation("vllm:d2t4+megatron:d1"), "vllm") == WeightGroup(
        9, (1, 5), 4
    )
    assert weight_update_group(
        parse_allocation("vllm:d3t2+megatron:d1"), "vllm", n_servers=3
    ).rank_offsets == (1, 3, 5)


def test_weight_group_refusals_name_vllm():
    with pytest.raises(
        ConfigError, match="vLLM servers' tensor parallel size is unknown.*'vllm:d2t4"
    ):
        weight_update_group(parse_allocation("megatron:d1"), "vllm", n_servers=2)
    with pytest.raises(ConfigError, match="vLLM joins the weight group"):
        weight_update_group(parse_allocation("vllm:d1t2p2+megatron:d1"), "vllm")
    with pytest.raises(ConfigError, match="2 server.*d1"):
        weight_update_group(parse_allocation("vllm:d1t2+megatron:d1"), "vllm", n_servers=2)
    with pytest.raises(ConfigError, match="rollout.backend='vllm' but allocation=.*'sglang'"):
        weight_update_group(parse_allocation("sglang:d1+megatron:d1"), "vllm")
    with pytest.raises(ConfigError, match="must be 'local', 'sglang' or 'vllm'"):
        weight_update_group(parse_allocation("vllm:d1+megatron:d1"), "tgi")

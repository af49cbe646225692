"""LoRA RL with images end to end on the CPU: GRPO steps of a tiny Qwen3-VL with ``lora.enabled``
through ``launch.local`` (the CPU rollout server serving the VL model class, each version's PEFT
adapter loaded by SGLang's LoRA API). Every step's server logprobs equal the trainer's
(``mismatch`` <= 1e-5: the server applies the trainer's adapters to the language model's layers
while it sees the same images), the adapters moved (the reference, the model with its adapters
off, drifts away: KL 0 at first, then positive), and the published PEFT adapter names the
language model's modules only (the vision tower frozen, without adapters)."""

import json

import pytest
from safetensors.torch import load_file

from areal_mega.data.synthetic_vision import write_task
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.local_runs import _finish, _launch, _metrics

TOL = 1e-5


def test_server_lora_layers_skip_the_vision_tower():
    """The rollout server's LoRA hooks are on the language model's linears only: Qwen2.5-VL's
    vision blocks have gate/up/down_proj too, whose rows are image patches, not requests."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from areal_mega.inference.lora_layers import LoraLayers

    torch.manual_seed(0)
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    vision_mlps = [n for n, _ in model.named_modules() if ".visual." in f".{n}." and "up_proj" in n]
    assert vision_mlps  # the tower has modules a target name matches
    hooked = sorted(LoraLayers(model, targets).modules)
    assert len(hooked) == 2 * len(targets)
    assert all(n.startswith("model.language_model.layers.") for n in hooked), hooked


def test_merging_a_vl_models_adapters_is_refused_at_config_load(tmp_path):
    """The vision-language HF export takes no merged LoRA deltas: ``lora.sync=merged`` in RL and
    LoRA SFT (whose ``hf_model`` is the merged model) stop at config load naming why; RL with
    ``lora.sync=adapter`` passes."""
    from transformers import Qwen3VLConfig

    from areal_mega.config import ConfigError, check_against_model, load_config

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    cfg = Qwen3VLConfig(text_config=dict(num_hidden_layers=2, rope_parameters=rope))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    base = ["lora.enabled=true", f"model.path={tmp_path}"]
    check_against_model(load_config(None, base))
    for extra, named in (("lora.sync=merged", "lora.sync=merged"), ("mode=sft", "mode=sft")):
        with pytest.raises(ConfigError, match="not merged into its weights") as e:
            check_against_model(load_config(None, [*base, extra]))
        assert named in str(e.value) and "qwen3_vl (vision-language)" in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qwen3_vl_lora_rl_steps_with_images_on_policy(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="qwen3_vl", charset="digits", seed=3)
    data = write_task(tmp_path / "data", "count", n_train=32, n_test=4, seed=0, question="=")
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run,
            model,
            data,
            "total_steps=3",
            "recover=off",
            "lora.enabled=true",
            "lora.rank=8",
            "lora.alpha=16",
            "ref.enabled=true",
            "algorithm.kl_coef=0.01",
            "rollout.max_head_offpolicyness=0",
            "rollout.weight_update=disk",
            "rollout.reward_fn=areal_mega.rewards:char_match_reward",
            "rollout.seeded_sampling=true",
            "data.apply_chat_template=true",
            "data.max_prompt_len=64",
            "optimizer.lr=1e-2",
            "optimizer.warmup_steps=0",
        ),
        timeout=400,
    )
    assert rc == 0, out[-3000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["mismatch_tokens"] > 0 and r["mismatch"] <= TOL, (r["step"], r["mismatch"])
    assert any(r.get("grad_norm", 0) > 0 for r in rows)
    assert rows[0]["kl_ref"] == 0.0 and rows[-1]["kl_ref"] > 0, [r["kl_ref"] for r in rows]
    published = sorted((run / "weights").iterdir())
    assert sorted(p.name for p in published[-1].iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    keys = load_file(published[-1] / "adapter_model.safetensors")
    assert all(".language_model." in k for k in keys), sorted(keys)[:4]
    assert json.loads((published[-1] / "adapter_config.json").read_text())["r"] == 8
    # PEFT starts B at zero: a B that is not zero any more is a trained adapter
    assert any(t.abs().max() > 0 for k, t in keys.items() if ".lora_B." in k), "no B moved"

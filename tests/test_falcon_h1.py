"""Falcon-H1 (areal_mega/models/falcon_h1.py): the configs the engine cannot build are refused
naming the key; its conversion rows are the bridge's registry in our model's names (the gated
Mamba norm only where the config has one); the CPU server's running batch keeps each layer's
Mamba states beside its attention keys. The end-to-end checks (conversion, transformers'
logits, TP2 / PP2, RL through the CPU server) are tests/test_new_families.py's."""

import pytest
import torch

from areal_mega.checkpoint.hf_mapping import hf_tensor_names, maps_for
from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf
from areal_mega.models.falcon_h1 import falcon_h1_refusals
from areal_mega.models.tiny import TinyModelSpec, make_tiny_model
from areal_mega.models.tiny_configs import tiny_hf_config


def _config(**kw) -> dict:
    spec = TinyModelSpec(arch="falcon_h1", hidden_size=32, intermediate_size=48)
    return dict(tiny_hf_config(spec, 22, 0, 1).to_dict(), **kw)


def test_configs_it_cannot_build_are_refused_naming_the_key():
    assert falcon_h1_refusals(_config()) == []
    for key, value in (
        ("hidden_act", "gelu"),
        ("mamba_conv_bias", False),
        ("mamba_proj_bias", True),
        ("projectors_bias", True),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("mamba_d_ssm", 48),
        ("time_step_limit", [0.0, 2.0]),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    ):
        (why,) = falcon_h1_refusals(_config(**{key: value}))
        assert why.split("=")[0].split(".")[0] == key, why
    # megatron's gated Mamba norm gates before normalising, with its epsilon fixed at 1e-5
    gated = _config(mamba_rms_norm=True, mamba_norm_before_gate=False)
    assert falcon_h1_refusals(gated) == []
    (why,) = falcon_h1_refusals(dict(gated, mamba_norm_before_gate=True))
    assert "mamba_norm_before_gate" in why
    (why,) = falcon_h1_refusals(dict(gated, rms_norm_eps=1e-6))
    assert "rms_norm_eps" in why
    # unused without the gated norm (transformers' default mamba_norm_before_gate=True)
    assert falcon_h1_refusals(_config(mamba_norm_before_gate=True)) == []
    with pytest.raises(ValueError, match="mlp_bias"):
        parse_hf_config(_config(mlp_bias=True))


def test_context_parallelism_is_refused_naming_why():
    arch = parse_hf_config(_config())
    with pytest.raises(ValueError, match="context parallelism"):
        transformer_config_from_hf(arch, cp=2)


def test_conversion_rows_are_the_registry_in_our_names():
    arch = parse_hf_config(_config())
    layer = {m.mcore: m.hf for m in maps_for(arch, 0)}
    assert layer["input_layernorm.weight"] == ("model.layers.{L}.input_layernorm.weight",)
    assert layer["pre_mlp_layernorm.weight"] == ("model.layers.{L}.pre_ff_layernorm.weight",)
    assert layer["self_attention.mamba_mixer.in_proj.weight"] == (
        "model.layers.{L}.mamba.in_proj.weight",
    )
    assert "self_attention.mamba_mixer.norm.weight" not in layer
    assert not [m for m in layer if m.startswith("mamba_mixer.") or "conv1d." in m]
    glob = {m.mcore for m in maps_for(arch)}
    assert "decoder.final_layernorm.weight" in glob
    gated = parse_hf_config(_config(mamba_rms_norm=True, mamba_norm_before_gate=False))
    assert "self_attention.mamba_mixer.norm.weight" in {m.mcore for m in maps_for(gated, 0)}
    names = hf_tensor_names(arch)
    assert len(names) == len(set(names)) == 2 + 2 * 16  # embed, norm (tied); 16 a layer


def test_server_batch_keeps_mamba_states_beside_attention_keys(tmp_path):
    """HFCacheBatch (the CPU server's running batch for Falcon-H1): rows of two prefills joined,
    then decoded step by step, give each sequence's logits run alone."""
    from transformers import AutoModelForCausalLM

    from areal_mega.inference.kv_cache import HFCacheBatch

    path = make_tiny_model(tmp_path / "m", arch="falcon_h1", hidden_size=32, charset="digits")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = HFCacheBatch(model)
    g = torch.Generator().manual_seed(0)
    first, second = torch.randint(3, 22, (2, 5), generator=g), torch.randint(3, 22, (1, 8))
    seqs = [first[0].tolist(), first[1].tolist(), second[0].tolist()]
    worst = 0.0
    with torch.no_grad():
        for ids in (first, second):
            _, kv = batch.prefill(ids)
            batch.append(kv, list(range(ids.shape[0])))
        for _ in range(3):
            nxt = torch.randint(3, 22, (len(seqs),), generator=g).tolist()
            logits = batch.decode(nxt)
            for i, s in enumerate(seqs):
                s.append(nxt[i])
                want = model(input_ids=torch.tensor([s]), use_cache=False).logits[0, -1]
                worst = max(worst, (logits[i] - want).abs().max().item())
    assert worst < 1e-5

"""Nemotron-H's HybridModel on the CPU (areal_mega/models/nemotron_h.py), one rank: the bridge's
provider fields, the local hybrid stack spec and the compat patches give transformers' logits
and gradients on packed sequences; the configs it cannot build are refused naming the key."""

import json
import os
import subprocess

import pytest
import torch

from areal_mega.models.backend import have_te
from areal_mega.models.nemotron_h import nemotron_h_refusals, nemotron_h_stage_refusal
from tests.helpers.nemotron_h_worker import tiny_config
from tests.helpers.workers import ROOT, worker_cmd, worker_env

pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_hybrid_model_at_one_rank_equals_transformers():
    """tests/helpers/nemotron_h_worker.py (a fresh process): logits and the gradients of a
    weighted logit sum (Mamba, attention, MLP, norms, embedding) within 1e-5 relative."""
    out = subprocess.run(
        worker_cmd("nemotron_h_worker"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(dict(os.environ, PYTHONWARNINGS="ignore")),
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("NEMOTRON_H ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads(line[0][len("NEMOTRON_H ") :])
    assert res["logits"] <= 1e-5, res
    assert len(res["grads"]) == 10 and max(res["grads"].values()) <= 1e-5, res["grads"]


def test_configs_it_cannot_build_are_refused_naming_the_key():
    base = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M*M-",
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "num_nextn_predict_layers": None,
    }
    assert nemotron_h_refusals(base) == []
    for key, value in (
        ("mamba_hidden_act", "relu"),
        ("use_conv_bias", False),
        ("conv_kernel", 3),
        ("use_bias", True),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("residual_in_fp32", True),
        ("num_nextn_predict_layers", 1),
        ("time_step_limit", [0.0, 2.0]),
        ("hybrid_override_pattern", "ME*-"),
        ("layer_norm_epsilon", 1e-6),
        ("tie_word_embeddings", True),
    ):
        (why,) = nemotron_h_refusals(dict(base, **{key: value}))
        assert why.startswith(f"{key}="), why


def test_pipeline_stages_of_the_layer_pattern():
    """Without '|' separators megatron slices the pattern evenly per PP stage (no VPP); with
    them, one segment per PP x VPP stage; anything else is refused naming the key."""
    plain, piped = {"hybrid_override_pattern": "M*M-"}, {"hybrid_override_pattern": "M*|M-"}
    assert nemotron_h_stage_refusal(plain, 1, None) is None
    assert nemotron_h_stage_refusal(plain, 2, None) is None
    assert nemotron_h_stage_refusal(piped, 2, None) is None
    assert nemotron_h_stage_refusal(piped, 1, 2) is None
    assert "2 pipeline segments" in nemotron_h_stage_refusal(piped, 1, None)
    assert "stage separators" in nemotron_h_stage_refusal(plain, 1, 2)


@pytest.mark.skipif(have_te(), reason="refused only where TransformerEngine is not used")
def test_context_parallelism_without_transformer_engine_is_refused_naming_why():
    """megatron's Mamba context parallelism splits packed sequences with TransformerEngine's
    thd_get_partitioned_indices: without it the build refuses, where the forward would fail on
    megatron's 'update Transformer Engine' assertion."""
    from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf

    arch = parse_hf_config(tiny_config().to_dict())
    with pytest.raises(ValueError, match="context parallelism needs TransformerEngine"):
        transformer_config_from_hf(arch, cp=2)
    assert transformer_config_from_hf(arch, cp=1).context_parallel_size == 1

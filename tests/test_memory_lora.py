"""The ``--dry-run`` memory estimate of a LoRA run (pure arithmetic, hand-computed): the frozen
base has no gradients or optimizer state, the adapters (r·(in+out) per targeted projection,
split by TP as the adapters are) carry weights + fp32 gradients + Adam, the reference model is
free; a separate reference of a full run costs its weights. Plus the LoRA recipes' dry runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.config import ConfigError, LoraConfig, ModelHParams
from areal_mega.launch.memory import (
    KNOWN_MODELS,
    estimate_memory,
    lora_estimate_args,
    lora_param_counts,
)
from areal_mega.parallel.allocation import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
# h=64, 4 heads of 16 (q 64), 2 kv heads (k, v 32), ffn 128, 4 layers
SMALL = ModelHParams(
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    vocab_size=100,
)
MOE = ModelHParams(
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    vocab_size=100,
    tie_word_embeddings=True,
    num_experts=4,
    moe_ffn_hidden_size=32,
    moe_topk=2,
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_adapter_counts_per_projection():
    # r=8 per layer: q 8(64+64) k,v 8(64+32) o 8(64+64) gate,up 8(64+128) down 8(128+64)
    per_layer = 8 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    full, per_rank = lora_param_counts(SMALL, 8, ALL)
    assert full == 4 * per_layer == 32768 and per_rank == full
    assert lora_param_counts(SMALL, 4, ["q_proj"]) == (4 * 4 * 128, 4 * 4 * 128)


def test_tensor_parallel_keeps_row_parallel_b_whole():
    # q (column-parallel): both halves split; o (row-parallel): A split, B [h, r] on every rank
    _, q = lora_param_counts(SMALL, 8, ["q_proj"], tp=2, layers=1)
    _, o = lora_param_counts(SMALL, 8, ["o_proj"], tp=2, layers=1)
    assert q == 8 * (64 + 64) / 2 and o == 8 * 64 / 2 + 8 * 64
    _, down = lora_param_counts(SMALL, 8, ["down_proj"], tp=4, layers=3)
    assert down == 3 * (8 * 128 / 4 + 8 * 64)


def test_refusals():
    with pytest.raises(ConfigError, match="'gate_proj' on an MoE model"):
        lora_param_counts(MOE, 8, ["q_proj", "gate_proj"])
    with pytest.raises(ConfigError, match="'qkv' is not one of"):
        lora_param_counts(SMALL, 8, ["qkv"])
    with pytest.raises(ConfigError, match="lora.rank=0"):
        lora_param_counts(SMALL, 0, ["q_proj"])
    assert lora_estimate_args(LoraConfig()) == {}  # lora.enabled=false: a full run
    args = lora_estimate_args(LoraConfig(enabled=True, rank=16, target_modules=["linear_q"]))
    assert args == {"lora_rank": 16, "lora_targets": ["q_proj"]}


def test_lora_estimate_hand_computed():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    full = estimate_memory(SMALL, dims, tokens_per_mb=1000, overhead_bytes=0)
    lora = estimate_memory(
        SMALL,
        dims,
        tokens_per_mb=1000,
        overhead_bytes=0,
        reference=True,
        lora_rank=8,
        lora_targets=ALL,
    )
    # 2 layers on a stage, TP 2, per r: q 64, k/v 48, o 32 + 64 (B whole), gate/up 96, down 64 + 64
    adapters = 2 * 8 * ((128 + 96 + 96) / 2 + (32 + 64) + (192 + 192) / 2 + (64 + 64))
    assert lora.trainable_per_gpu == adapters == 9216 and lora.trainable_params == 32768
    assert lora.params_per_gpu == full.params_per_gpu + adapters
    assert lora.weights == 2 * (40320 + adapters)  # frozen bf16 base + bf16 adapters
    assert lora.grads == 4 * adapters  # fp32 grads of the adapters only
    assert lora.optimizer == 12 * adapters / 2  # master + m + v, sharded over DP 2
    assert lora.reference == 0.0  # adapters off: no second model
    assert lora.activations == full.activations and lora.logits == full.logits
    assert lora.total < full.total
    out = lora.format(80.0)
    assert "LoRA r=8: 32.8K trainable params (9.2K on this GPU)" in out
    assert "reference" not in out.split("\n")[2]  # no reference category


def test_full_run_reference_costs_its_weights():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    plain = estimate_memory(SMALL, dims, tokens_per_mb=1000, overhead_bytes=0)
    ref = estimate_memory(SMALL, dims, tokens_per_mb=1000, overhead_bytes=0, reference=True)
    assert ref.reference == 2 * 40320 and ref.total == plain.total + 2 * 40320
    assert "reference 78.8 KiB" in ref.format() and "reference" not in plain.format()


def test_moe_attention_adapters_and_fp32():
    e = estimate_memory(
        MOE,
        ParallelDims(dp=4, ep=2),
        tokens_per_mb=10,
        overhead_bytes=0,
        dtype="fp32",
        use_distributed_optimizer=False,
        lora_rank=4,
        lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    adapters = 2 * 4 * 4 * 128  # 2 layers x 4 projections x r(64 + 64); MHA: kv = q
    assert e.trainable_per_gpu == adapters
    assert e.grads == 4 * adapters and e.optimizer == 8 * adapters  # fp32: Adam m, v only
    big = KNOWN_MODELS["qwen3-30b-a3b"]
    n, _ = lora_param_counts(big, 32, ["q_proj", "k_proj", "v_proj", "o_proj"])
    # per layer 32 * ((2048+4096) + 2*(2048+512) + (4096+2048)) = 557,056; 48 layers
    assert n == 48 * 557056


def _dry_run(recipe, *overrides):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.local",
            "--config",
            str(ROOT / "recipes" / recipe),
            "--dry-run",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_of_a_lora_recipe_counts_the_adapters():
    r = _dry_run("qwen2.5-7b-math-lora.yaml", "ref.enabled=true")
    assert r.returncode == 0, r.stderr
    # all seven projections of Qwen2.5-7B at r=32: 80.7M (PEFT's count for this model)
    assert "LoRA r=32: 80.7M trainable params (80.7M on this GPU)" in r.stdout, r.stdout
    assert "weight update: disk" in r.stdout and "| reference" not in r.stdout, r.stdout
    full = _dry_run("qwen2.5-7b-math.yaml", "ref.enabled=true")
    assert full.returncode == 0 and "| reference 7.09 GiB" in full.stdout, full.stdout


def test_moe_lora_recipe_targets_attention_only():
    r = _dry_run("qwen3-30b-a3b-math-lora.yaml")
    assert r.returncode == 0 and "LoRA r=32: 26.7M trainable params" in r.stdout, r.stderr
    bad = _dry_run("qwen3-30b-a3b-math-lora.yaml", "lora.target_modules=[q_proj,gate_proj]")
    assert bad.returncode == 2 and "'gate_proj' on an MoE model" in bad.stderr, bad.stderr

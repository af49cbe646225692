"""A bf16 actor as the trainer builds and loads it computes like megatron's bf16 on a GPU:
bf16 weights (every parameter, the norms too), an fp32 main copy of each in the optimizer that
starts as the loaded weights, fp32 gradient buffers, fp32 log-probabilities from the bf16 logits
and an fp32 loss; its steps move the weights (tests/helpers/bf16_worker.py, one gloo process).
The end-to-end bf16 run is tests/test_e2e_bf16.py."""

import os

import pytest

from tests.helpers.workers import run_worker


@pytest.mark.timeout(600)
def test_bf16_actor_keeps_fp32_main_params_logprobs_and_loss(assets, tmp_path):
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    f = run_worker("bf16_worker", assets[0], tmp_path, out, out=out, timeout=540, env=env)
    assert f["param_dtypes"] == ["torch.bfloat16"]
    assert f["n_main"] == f["n_params"] > 0  # every parameter has a main copy ...
    assert f["main_dtypes"] == ["torch.float32"]  # ... in fp32
    assert f["main_hold_loaded"]  # the loaded weights, not those of before the load
    assert f["grad_buffer_dtypes"] == ["torch.float32"]
    assert f["logprob_dtypes"] == ["torch.float32"]
    assert f["loss_logprob_dtypes"] == ["torch.float32"]
    assert f["loss_dtypes"] == ["torch.float32"]
    assert all(abs(x) < 1e3 for x in f["losses"])
    assert f["max_change"] > 0  # the steps moved the weights
    assert f["main_round_to_params"]  # the bf16 weights are the rounded main params
    # the engine writes the logits' gradient over them, and that changes no gradient
    assert f["grad_in_logits_asked"] == [True]
    assert f["grad_in_logits_equal"]

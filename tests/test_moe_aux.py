"""MoE load-balancing loss: the builder reads ``router_aux_loss_coef``, and a real engine step
gives the router exactly the gradient of coef · Σ_mb aux_mb · T_mb / Σ_mb T_mb (compared with
an independent torch computation in tests/helpers/moe_aux_worker.py), and logs the aux loss."""

import json
import os
import subprocess

import pytest

from tests.helpers.workers import ROOT, worker_cmd, worker_env


def test_builder_reads_router_aux_loss_coef(tmp_path):
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply()
    from areal_mega.models.builder import (
        load_hf_config,
        parse_hf_config,
        transformer_config_from_hf,
    )
    from areal_mega.models.tiny import make_tiny_model

    hf = load_hf_config(make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4))
    assert hf["router_aux_loss_coef"] == pytest.approx(0.001)  # Qwen3-MoE's default
    cfg = transformer_config_from_hf(parse_hf_config(hf))
    assert cfg.moe_aux_loss_coeff == pytest.approx(0.001)
    assert cfg.moe_router_load_balancing_type == "aux_loss"
    off = transformer_config_from_hf(parse_hf_config(dict(hf, router_aux_loss_coef=0.0)))
    assert off.moe_router_load_balancing_type == "none"


def test_aux_coeff_for_step():
    from areal_mega.engine.moe_aux import aux_coeff_for_step

    assert aux_coeff_for_step(0.01, 100, 1) == pytest.approx(1e-4)
    assert aux_coeff_for_step(0.01, 100, 4) == pytest.approx(4e-4)  # CP·TP ranks share tokens
    # megatron-core 0.19 multiplies by the TP×CP size itself: TP2 with SP, and TP2 without
    assert aux_coeff_for_step(0.01, 100, 2, tp_cp_size=2) == pytest.approx(1e-4)
    assert aux_coeff_for_step(0.01, 100, 1, tp_cp_size=2) == pytest.approx(5e-5)
    assert aux_coeff_for_step(0.01, 0, 1) == 0.0


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_aux") / "res.json"
    proc = subprocess.run(
        worker_cmd("moe_aux_worker", out),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")),
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res.get("error")
    return res


def test_router_grad_matches_per_token_reference(worker):
    assert worker["n_router_calls"] == 3 and len(set(worker["tokens"])) > 1
    assert worker["moe_aux_loss_coeff"] == pytest.approx(0.01)
    assert worker["grad_ref_max_abs"] > 1e-5  # the aux gradient is not trivially zero
    assert worker["grad_max_abs_diff"] <= 1e-5 * worker["grad_ref_max_abs"] + 1e-9, worker
    assert worker["coeff_restored"] == pytest.approx(0.01)


def test_aux_loss_does_not_change_main_loss_or_unrelated_grads(worker):
    assert worker["loss_a"] == worker["loss_b"]
    assert worker["output_layer_grad_diff"] == 0.0


def test_aux_loss_is_logged_in_step_stats(worker):
    assert {"moe_aux_loss_sum", "moe_aux_loss_tokens"} <= set(worker["stats_keys"])
    assert worker["aux_logged"] == pytest.approx(worker["aux_ref_mean"], rel=1e-5)
    from areal_mega.algo.policy_loss import finalize_stats

    fin = finalize_stats({"moe_aux_loss_sum": 3.0, "moe_aux_loss_tokens": 2.0, "token_count": 7.0})
    assert fin["moe_aux_loss"] == pytest.approx(1.5)  # what the trainer reports

"""Multi-process CPU (gloo, 2 ranks) equality of engine layouts against a single-rank reference.

One launch runs the CPU scenarios (dense, MoE, VPP), each many checks in sequence; see
tests/helpers/engine_worker.py. Every layout's per-token logprobs and gradients must match the
TP1/PP1 reference within 1e-5 (fp32), with the production losses (decoupled PPO with KL and entropy
terms, a GSPO / sequence-mean variant on the pipeline layouts, SFT on the MoE layouts). The
VPP scenario trains the interleaved pipeline (PP2 × VPP2) with equal and variable micro-batch
lengths.
"""

import os

import pytest
import torch

from areal_mega.common.net import free_port
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd

WORKER = "engine_worker"  # tests.helpers.engine_worker
TOL = 1e-5


def _launch(scenario, tmp_path, world=2, timeout=240):
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = run_ranks(
        [worker_cmd(WORKER, scenario, r, world, port, tmp_path) for r in range(world)],
        timeout=timeout,
        env=env,
    )
    return rank_results([tmp_path / f"{scenario}.{r}.json" for r in range(world)], ranks)


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    """Every rank's results of the dense, MoE and VPP scenarios (their keys are disjoint)."""
    return _launch("cpu", tmp_path_factory.mktemp("cpu"), timeout=480)


@pytest.fixture(scope="module")
def dense(cpu):
    return cpu


@pytest.fixture(scope="module")
def moe(cpu):
    return cpu


def _worst(results, key):
    return max(r[key] for r in results)


@pytest.mark.parametrize(
    "layout",
    [
        "dp2",
        "dp2_big_untied",
        "dp2_big_tied",
        "tp2",
        "tp2sp",
        "qwen2_tp2sp",
        "pp2_tied",
        "pp2_shared_prompts",
        "tp2_shared_prompts",
    ],
)
def test_dense_layouts_match_single_rank(dense, layout):
    for what in ("logprobs", "grads", "loss", "n_tokens", "grad_norm"):
        assert _worst(dense, f"{layout}.{what}") < TOL, (layout, what, dense[0])


@pytest.mark.parametrize("layout", ["tp2", "pp2_tied"])
def test_prox_from_the_training_forward_trains_like_a_separate_forward(dense, layout):
    """The trainer skips the proximal forward when one optimizer step follows it
    (trainer.prox_forward_needed); the loss then takes π_prox from the training forward."""
    for what in ("grads", "loss"):
        assert _worst(dense, f"{layout}.prox_from_forward.{what}") < TOL, (layout, what)


def test_shared_prompts_ran_once_under_the_pipeline(dense):
    """PP2's micro-batches of prompt groups ran fewer rows than they pack (each shared prompt
    but its last token once; the 3-token prompt's group too), compared above."""
    for r in dense:
        # packed lengths 53, 89, 20, 21 padded to multiples of 8; groups of 3, 4, 2, 3 samples
        assert r["pp2_shared_prompts.model_rows"] == [
            56 - 2 * 10,
            96 - 3 * 16,
            24 - 7,
            24 - 2 * 2,
        ], r


def test_packed_equals_alone(dense):
    assert _worst(dense, "packed_vs_alone") < TOL


def test_checkpoint_tp1_to_tp2_reload(dense):
    assert all(r["tp2.before_reload_differs"] == 1.0 for r in dense)
    assert _worst(dense, "ckpt_tp1_to_tp2.logprobs") < TOL
    assert all(r["ckpt_tp1_to_tp2.extra_ok"] == 1.0 for r in dense)


def test_ten_steps_lower_loss(dense):
    for r in dense:
        assert r["train10.last_loss"] < r["train10.first_loss"] - 0.05, r
        if not torch.cuda.is_available():  # compat's cpu_fused_adam: torch's fused kernel
            assert r["train10.adam_fused"] == 1.0, r


@pytest.fixture(scope="module")
def vpp(cpu):
    return cpu


@pytest.mark.parametrize("case", ["vpp_same", "vpp_var"])
def test_interleaved_pipeline_trains_like_single_rank(vpp, case):
    """PP2 × VPP2 (tied embeddings, 4 layers), micro-batches of one length (vpp_same) and of
    variable lengths (vpp_var): logprobs, gradients, loss and one optimizer step (its loss and
    the updated parameters) equal the single-rank reference."""
    for r in vpp:
        for what in ("logprobs", "grads", "loss", "n_tokens", "step_loss", "step_params"):
            assert r[f"{case}.{what}"] < TOL, (case, what, r)
        assert r[f"{case}.step_moved"] > 1e-4, r  # the step really moved the weights


def test_interleaved_pipeline_refuses_a_micro_batch_count_not_a_multiple_of_pp(vpp):
    for r in vpp:
        assert "needs a multiple of PP=2 micro-batches, got 3" in r["vpp.odd_count_error"]


@pytest.mark.parametrize("layout", ["ep2", "moe_tp2sp", "moe_tp2sp_etp1"])
def test_moe_layouts_match_single_rank(moe, layout):
    """EP2 in DP2, TP2 (experts split by TP) and TP2 with the experts whole on each rank
    (expert TP 1, expert DP 2): logprobs, gradients and the optimizer's gradient norm."""
    for what in ("logprobs", "grads", "loss", "n_tokens", "grad_norm"):
        assert _worst(moe, f"{layout}.{what}") < TOL, (layout, what, moe[0])


def _cuda_count():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# bf16 tolerances (the GPU scenarios run bf16: TransformerEngine has no fp32 THD attention).
# bf16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 2e-3 per operation); the tiny model's
# logits are O(0.1-1), and layouts differ only in GEMM tiling / reduction order / attention
# kernel splits, so per-token logprobs move by a few 1e-3: 2e-2 is a 5x margin. Gradients are
# accumulated in fp32 (main_grad) from bf16 backward passes; their relative L2 error is bounded
# at 3e-2. The loss is a mean of O(1) terms: 1e-2.
BF16_LOGPROBS, BF16_GRADS_REL, BF16_LOSS = 2e-2, 3e-2, 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 1, reason="needs a GPU with TransformerEngine")
def test_gpu_te_thd_packed_equals_alone(tmp_path):
    res = _launch("gpu_thd", tmp_path, world=1)
    assert res[0]["thd.packed_vs_alone"] < BF16_LOGPROBS, res[0]


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 2, reason="context parallelism 2 needs 2 GPUs (NCCL)")
def test_gpu_cp2_matches_cp1(tmp_path):
    res = _launch("gpu_cp2", tmp_path, world=2)
    for r in res:
        assert r["cp2.logprobs"] < BF16_LOGPROBS, r
        assert r["cp2.grads_rel"] < BF16_GRADS_REL, r
        assert r["cp2.loss"] < BF16_LOSS, r
        assert r["cp2.n_tokens"] == 0.0, r

"""LoRA on every trainer layout equals one rank (fp32, gloo, tests/helpers/lora_worker.py).

A TP1 reference actor with random adapters writes them as a PEFT directory; each layout loads
its base from the converted checkpoint and its adapters from that directory, then its
logprobs, the adapters' gradients (gathered under their PEFT names), the loss and the adapters
after one Adam step must equal the reference's: DP2 (regular and distributed optimizer), TP2,
TP2 + sequence parallelism, PP2, PP2 x VPP2 (4 layers), TP2 with a subset of the projections,
and EP2 on a MoE model (attention adapters). Only the adapters train: they are the trainable
parameters and all the
optimizer holds.
"""

import pytest

from tests.helpers.lora_layouts import launch

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_models")
    launch("prepare", out, world=1)
    return out


@pytest.fixture(scope="module")
def dense(models):
    return launch("layouts", models)


@pytest.mark.parametrize(
    "layout", ["dp2", "dp2_distopt", "tp2", "tp2sp", "pp2", "tp2_subset", "pp2vpp2"]
)
def test_dense_layouts_equal_one_rank(dense, layout):
    whats = ["logprobs", "loss", "step"] + ([] if layout == "dp2_distopt" else ["grads"])
    for r in dense:
        for what in whats:
            assert r[f"{layout}.{what}"] < TOL, (layout, what, r)
        assert r[f"{layout}.only_adapters_train"] == 1.0, (layout, r)


def test_adapter_checkpoint_saved_at_tp2_resumes_at_tp1(dense):
    """The adapters (gate/up included: saved with plain TP sharding) reshard exactly."""
    for r in dense:
        assert r["ckpt_tp2_to_tp1"] < TOL, r


def test_expert_parallel_moe_with_attention_adapters_equals_one_rank(dense):
    for r in dense:
        for what in ("logprobs", "grads", "loss", "step"):
            assert r[f"ep2.{what}"] < TOL, (what, r)
        assert r["ep2.only_adapters_train"] == 1.0, r

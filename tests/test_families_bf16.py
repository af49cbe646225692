"""The newest families in bf16 (tests/helpers/family_bf16_worker.py, one gloo process): a bf16
engine built from the converted checkpoint as the trainer builds it keeps bf16 parameters and
returns fp32 logprobs, and its logprobs are as close to transformers' fp32 ones as
transformers' own bf16 run is (bf16 rounds differently on every CPU, so the bound is that run's
distance, not a fixed number); the same weights in fp32 agree with transformers to 1e-5."""

import os

import pytest

from areal_mega.models.tiny import make_tiny_model
from tests.helpers.new_families import CASES, tiny_spec
from tests.helpers.workers import run_worker


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gemma4_text", "gemma4_text_moe", "falcon_h1_gated"])
def test_bf16_engine_is_as_close_to_transformers_as_its_own_bf16(tmp_path, name):
    model = make_tiny_model(tmp_path / "hf", **tiny_spec(CASES[name]))
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    f = run_worker("family_bf16_worker", model, tmp_path, out, out=out, timeout=540, env=env)
    assert f["bf16.param_dtypes"] == ["torch.bfloat16"] and f["bf16.logprob_dtype"] == (
        "torch.float32"
    )
    assert f["fp32.vs_hf_fp32"] < 1e-5, f
    hf_bf16 = f["hf_bf16.vs_hf_fp32"]
    assert hf_bf16 > 1e-4, f  # bf16 rounding shows at all: the bound below means something
    assert 1e-4 < f["bf16.vs_hf_fp32"] <= 2 * hf_bf16 + 0.01, f

"""Qwen2.5-VL under the interleaved pipeline: PP2 with two virtual stages per rank (a tiny model
of 4 layers, one per chunk; the vision tower on the first chunk of the first stage) against one
rank on the same two micro-batches with images: logprobs, loss, the vision tower's gradients and
the language model's gradient norm (tests/helpers/vlm_layout_worker.py). Context parallelism
and Qwen3-VL's virtual stages are refused with their reason."""

import json

import pytest

from areal_mega.models.tiny import make_tiny_model
from tests.helpers.conversions import ROOT

TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("vl_vpp") / "hf", arch="qwen2_5_vl", charset="digits", num_layers=4
    )


def _run(argvs, timeout=400):
    from tests.helpers.multirank import run_ranks

    ranks = run_ranks(argvs, timeout=timeout)
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + out[-6000:]


def test_pp2_vpp2_equals_the_single_rank(hf_dir, tmp_path):
    import subprocess
    import sys

    from areal_mega.common.net import free_port
    from tests.helpers.workers import worker_cmd

    mcore = tmp_path / "mcore"
    p = subprocess.run(
        [sys.executable, "tools/convert_hf_to_mcore.py", "--hf-dir", str(hf_dir), "--out", mcore],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    ref = tmp_path / "ref.pt"
    args = (hf_dir, mcore, ref)
    _run([worker_cmd("vlm_layout_worker", "single", *args, 0, 1, free_port(), tmp_path)])
    port = free_port()
    _run(
        [worker_cmd("vlm_layout_worker", "pp2vpp2", *args, r, 2, port, tmp_path) for r in range(2)]
    )
    for r in range(2):
        res = json.loads((tmp_path / f"pp2vpp2.{r}.json").read_text())
        assert res["vision_grad_scale"] > 1e-3, res  # the tower's gradients are not zero
        assert res["logprobs"] < TOL and res["loss"] < 1e-6, res
        assert res["lm_grad_norm"] < 1e-6, res
        # the vision tower: on the first stage's first chunk only
        assert res["has_vision"] == (r == 0), res
        assert not res["has_vision"] or res["vision_grads"] < 1e-6, res

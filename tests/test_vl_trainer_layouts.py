"""A real RL step's data path with images on the tiny Qwen2.5-VL (tests/helpers/
vl_trainer_worker.py): trajectories with images -> plan_step -> distribute -> the actor's
proximal logprobs, the reference model's and OPD's in-trainer teacher's logprobs, the
policy loss's train step and its ``mismatch``. At one rank the proximal logprobs equal
transformers' with the images (the behaviour logprobs the trajectories carry), so the mismatch
over the same-version tokens is
~0; at DP2, TP2 and PP2 the logprobs, loss and gradients equal the single rank's."""

import subprocess
import sys

import pytest

from areal_mega.models.tiny import make_tiny_model
from tests.helpers.conversions import ROOT

TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("vl_trainer") / "hf", arch="qwen2_5_vl", charset="digits"
    )


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl_trainer_mcore") / "mcore"
    p = subprocess.run(
        [
            sys.executable,
            "tools/convert_hf_to_mcore.py",
            "--hf-dir",
            str(hf_dir),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return out


def _run(layout, world, hf_dir, mcore_dir, out_dir):
    from areal_mega.common.net import free_port
    from tests.helpers.multirank import rank_results, run_ranks
    from tests.helpers.workers import worker_cmd

    port = free_port()
    args = (layout, hf_dir, mcore_dir)
    ranks = run_ranks(
        [worker_cmd("vl_trainer_worker", *args, r, world, port, out_dir) for r in range(world)],
        timeout=500,
    )
    for r, (rc, log) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + log[-6000:]
    return rank_results([out_dir / f"{layout}.{r}.json" for r in range(world)], ranks)


@pytest.fixture(scope="module")
def single(hf_dir, mcore_dir, tmp_path_factory):
    (res,) = _run("single", 1, hf_dir, mcore_dir, tmp_path_factory.mktemp("vl_single"))
    return res


def _max_diff(a: dict, b: dict, keys=None) -> float:
    keys = a.keys() if keys is None else keys
    return max(abs(x - y) for k in keys for x, y in zip(a[k], b[k], strict=True))


def test_one_rank_sees_the_images_in_every_forward(single):
    # 4 prompt groups of 3 samples (1, 2, 0 and 1 images): every sample carries its own grid
    assert sorted(single["prox"]) == sorted(f"g{g}-s{k}" for g in range(4) for k in range(3))
    assert sum(n for n, _ in single["images"]) == 3 * (1 + 2 + 0 + 1)
    assert all(n == rows for n, rows in single["images"])
    assert len(single["images"]) > 1  # the budget split the step
    # the proximal forward = transformers' with the images (the behaviour logprobs)
    assert _max_diff(single["prox"], single["behav"]) < TOL
    assert _max_diff(single["prox"], single["ref"]) < TOL  # the reference model, same weights
    # OPD's in-trainer teacher (a VL model on the same checkpoint) sees them too
    assert _max_diff(single["prox"], single["teacher"]) < TOL
    assert single["opd_abs_log_ratio"] < TOL
    n_loss = sum(len(v) for v in single["prox"].values())
    assert single["mismatch_tokens"] == n_loss and single["mismatch"] < TOL
    # the images reach the backward: the vision tower has gradients
    assert single["vision"] and min(single["vision"].values()) > 0
    assert single["grad_norm"] > single["lm_grad_norm"] > 0


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_two_rank_layouts_equal_the_single_rank(layout, single, hf_dir, mcore_dir, tmp_path):
    res = _run(layout, 2, hf_dir, mcore_dir, tmp_path)
    if layout == "dp2":  # each DP rank its own samples, with their images
        a, b = (set(r["prox"]) for r in res)
        assert not a & b and a | b == set(single["prox"])
        assert sum(n for r in res for n, _ in r["images"]) == 12
    for r, got in enumerate(res):
        assert all(n == rows for n, rows in got["images"])
        for key in ("prox", "ref", "teacher", "behav"):
            assert _max_diff(got[key], single[key], got[key].keys()) < TOL, (layout, r, key)
        assert abs(got["loss"] - single["loss"]) < TOL, (layout, r)
        assert abs(got["grad_norm"] - single["grad_norm"]) < TOL * single["grad_norm"]
        assert abs(got["lm_grad_norm"] - single["lm_grad_norm"]) < TOL * single["lm_grad_norm"]
        assert got["mismatch"] < TOL and got["mismatch_tokens"] == single["mismatch_tokens"]
        if layout == "pp2" and r == 1:
            assert got["vision"] == {}  # the tower sits on the first stage
            continue
        assert got["vision"].keys() == single["vision"].keys()
        for n, norm in single["vision"].items():
            assert abs(got["vision"][n] - norm) <= TOL * norm, (layout, r, n)

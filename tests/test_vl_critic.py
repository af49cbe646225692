"""The critic (PPO value model) of a vision-language student (tests/helpers/vl_critic_worker.py):
the tiny Qwen2.5-VL with a value head in place of its language model's output layer, built by
``critic_step.build_critic``, its trunk (vision tower + language model) loaded from the
converted VL checkpoint by ``init_critic``, then ``gae_step`` and ``train_critic`` on a real
step's trajectories with images. At one rank its values are transformers' final hidden states
(with the images) times the fresh head, they change with other pictures (and not for a text-only
prompt), a PPO step moves them and the vision tower, and a saved critic restores to the same
values; ``model.freeze_vision`` keeps the tower fixed; DP2 and TP2 equal the single rank."""

import subprocess
import sys

import pytest

from areal_mega.models.tiny import make_tiny_model
from tests.helpers.conversions import ROOT

TOL = 1e-5
TEXT_ONLY = "g2"  # the worker's prompt group without images


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("vl_critic") / "hf", arch="qwen2_5_vl", charset="digits"
    )


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl_critic_mcore") / "mcore"
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
        [worker_cmd("vl_critic_worker", *args, r, world, port, out_dir) for r in range(world)],
        timeout=500,
    )
    for r, (rc, log) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + log[-6000:]
    return rank_results([out_dir / f"{layout}.{r}.json" for r in range(world)], ranks)


@pytest.fixture(scope="module")
def single(hf_dir, mcore_dir, tmp_path_factory):
    (res,) = _run("single", 1, hf_dir, mcore_dir, tmp_path_factory.mktemp("vl_critic_single"))
    return res


def _max_diff(a: dict, b: dict, keys=None) -> float:
    keys = a.keys() if keys is None else keys
    return max(abs(x - y) for k in keys for x, y in zip(a[k], b[k], strict=True))


def test_values_are_the_vl_trunks_hidden_states_with_the_images(single):
    assert sorted(single["values"]) == sorted(f"g{g}-s{k}" for g in range(4) for k in range(3))
    assert all(len(v) > 0 for v in single["values"].values())
    assert single["head_shape"] == [1, 64]  # the value head, not the LM head
    # the checkpoint's vision tower and language model, the images through the tower
    assert sorted(single["hf"]) == sorted(single["values"])
    assert _max_diff(single["values"], single["hf"]) < TOL


def test_values_depend_on_the_images(single):
    imaged = [s for s in single["values"] if not s.startswith(TEXT_ONLY)]
    for s in imaged:  # other pictures, same tokens: other values for every image sample
        assert _max_diff(single["values"], single["other"], [s]) > 1e-3, s
    text = [s for s in single["values"] if s.startswith(TEXT_ONLY)]
    assert text and _max_diff(single["values"], single["other"], text) == 0.0


def test_a_ppo_step_trains_the_critic_and_its_checkpoint_restores_it(single):
    st = single["stats"]
    assert st["critic/grad_norm"] > 0 and st["critic/value_loss"] > 0
    assert abs(st["critic/old_value_mean"] - st["critic/value_mean"]) < TOL
    # GAE: returns = advantages + old values on every loss token
    for s, ret in single["returns"].items():
        for r, a, v in zip(ret, single["advantages"][s], single["values"][s], strict=True):
            assert abs(r - (a + v)) < TOL, s
    assert _max_diff(single["values"], single["after"]) > 1e-2  # the step moved the values
    assert single["n_vision"] > 0 and single["vision_moved"] > 0  # the tower trains too
    assert _max_diff(single["after"], single["restored"]) == 0.0


def test_freeze_vision_keeps_the_critics_vision_tower(hf_dir, mcore_dir, single, tmp_path):
    (res,) = _run("frozen", 1, hf_dir, mcore_dir, tmp_path)
    assert res["n_vision"] > 0 and res["vision_moved"] == 0.0
    assert res["merger_moved"] > 0  # its projector trains, as the actor's
    assert _max_diff(res["values"], single["values"]) < TOL  # same start, images seen


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_layouts_equal_the_single_rank(layout, hf_dir, mcore_dir, single, tmp_path):
    ranks = _run(layout, 2, hf_dir, mcore_dir, tmp_path)
    seen = set()
    for res in ranks:
        seen |= set(res["values"])
        for key in ("values", "advantages", "returns", "after"):
            assert _max_diff(res[key], single[key]) < TOL, key
        # the control's pictures are drawn per rank's micro-batches: only that they matter
        for s in res["values"]:
            if not s.startswith(TEXT_ONLY):
                assert _max_diff(res["values"], res["other"], [s]) > 1e-3, s
        for k, v in single["stats"].items():
            assert abs(res["stats"][k] - v) < TOL * max(1.0, abs(v)), k
    assert seen == set(single["values"])  # DP2: each rank its share; TP2: all on both

"""Every ``algorithm.preset`` starts and trains 2 RL steps through ``launch.local`` (CPU, tiny
model): its keys reach the trainer (the run's resolved config) and the steps log finite
losses. The recipe here is tiny-cpu without its ``algorithm`` / ``critic`` sections, so the
preset's keys are not overridden by the recipe's (explicit keys win, tested in
tests/test_config_presets.py); the reward is the dense character match, so DAPO's dynamic
filter finds non-uniform groups. ``opd`` (it needs a teacher) gets the same checks on the first
run of tests/test_e2e_opd.py (the full tiny-cpu recipe sets none of its keys).

The runs join one CPU rollout server of this module (``rollout.server_addrs``: launch.local
starts none), brought back before each run to what a server launch.local starts would hold:
the tiny model's weights at version 0, generating. Each run's own start and stop of a server
would add nothing the other end-to-end tests do not check."""

import os
import subprocess
import sys

import pytest
import yaml

from areal_mega.config import PRESETS
from areal_mega.inference.process import launch_local_servers
from tests.helpers.local_runs import ROOT, _finish, _metrics, check_preset_run, fresh_server

pytestmark = pytest.mark.slow


def _recipe(tmp_path):
    data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    for section in ("algorithm", "critic"):
        data.pop(section, None)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def shared_server(assets):
    """One CPU rollout server on the tiny model for every run of the module."""
    (srv,) = launch_local_servers(str(assets[0]), 1)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def server_addr(shared_server, assets):
    """The shared server's address, the server as launch.local would have started it."""
    return fresh_server(shared_server.addr, assets[0])


def _run_preset(preset, assets, server_addr, tmp_path, reward="char_match_reward"):
    model, data = assets
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "areal_mega.launch.local",
        "--config",
        str(_recipe(tmp_path)),
        f"model.path={model}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.test_path={data / 'test.jsonl'}",
        f"logging.run_dir={run}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "rollout.batch_size=4",
        "rollout.n_samples=4",
        "cluster.kill_grace_s=5",
        "total_steps=2",
        "recover=off",
        "checkpoint.save_every=0",
        f"rollout.reward_fn=areal_mega.rewards:{reward}",
        f"algorithm.preset={preset}",
        f"rollout.server_addrs=[{server_addr}]",
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rc, out = _finish(proc, timeout=360)
    assert rc == 0, out[-3000:]
    return run


@pytest.mark.timeout(400)
@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"opd"}))  # opd: test_e2e_opd.py
def test_every_preset_trains_two_steps(preset, assets, server_addr, tmp_path):
    check_preset_run(_run_preset(preset, assets, server_addr, tmp_path), preset, steps=2)


@pytest.mark.timeout(400)
def test_steps_the_dynamic_filter_empties_train_nothing_and_the_run_goes_on(
    assets, server_addr, tmp_path
):
    """DAPO with the exact-match reward on an untrained model: every group is uniform (all
    0), so every step is empty; each takes no optimizer step (no loss, no lr) and the
    versions still advance."""
    run = _run_preset("dapo", assets, server_addr, tmp_path, reward="exact_match_reward")
    check_preset_run(run, "dapo", steps=2)
    for r in _metrics(run):
        if r["step"] >= 1:
            assert r["n_samples"] == 0 and r["filter/uniform_groups"] == 4, r
            assert "lr" not in r and "grad_norm" not in r and r["version"] == r["step"], r

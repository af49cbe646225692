"""The rollout worker process end to end: dataset -> servers -> data plane, weight updates over
the control channel (a real server, a real worker process, real ZMQ sockets)."""

import json
import subprocess
import sys

import pytest
import yaml

from areal_mega.dataplane import TrajectoryReceiver
from areal_mega.dataplane.control import RolloutLink
from areal_mega.inference.process import launch_local_servers
from tests.helpers.rollout import API_KEY, make_models

pytestmark = pytest.mark.timeout(240)


def test_worker_streams_groups_and_updates_weights(tmp_path_factory, tmp_path):
    a, b = make_models(tmp_path_factory)
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    procs = launch_local_servers(str(a), 1, api_key=API_KEY)
    recv = TrajectoryReceiver(f"ipc://{tmp_path}/traj.sock")
    worker = None
    try:
        cfg = {
            "model": {"path": str(a)},
            "logging": {"run_dir": str(tmp_path / "run")},
            "data": {"train_path": str(data)},
            "dataplane": {
                "endpoint": f"ipc://{tmp_path}/traj.sock",
                "control_endpoint": f"ipc://{tmp_path}/ctl.sock",
            },
            "rollout": {
                "server_addrs": [procs[0].addr],
                "api_key": API_KEY,
                "batch_size": 2,
                "n_samples": 2,
                "max_new_tokens": 8,
                "max_head_offpolicyness": 0,
                "workflow": "rlvr",
                "reward_fn": "areal_mega.rewards:exact_match_reward",
            },
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        worker = subprocess.Popen(
            [sys.executable, "-m", "areal_mega.rollout.worker", "--config", str(path)]
        )
        got = []
        while len(got) < 4:  # eta = 0: exactly batch_size groups, then it waits
            t = recv.recv(timeout=60)
            assert t is not None, "no trajectory from the worker"
            got.append(t)
        assert recv.recv(timeout=1.0) is None
        assert {int(t.versions[t.prompt_len :].min()) for t in got} == {0}
        link = RolloutLink(f"ipc://{tmp_path}/ctl.sock", timeout_s=60)
        assert link.update_weights(version=1, path=str(b))["version"] == 1
        more = [recv.recv(timeout=60) for _ in range(4)]
        assert all(t is not None and t.versions[t.prompt_len :].min() == 1 for t in more)
        assert link.stats()["accepted"] == 4
        link.close()
    finally:
        if worker is not None:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        recv.close()
        for p in procs:
            p.stop()

"""Pure parts of elastic rollout: GPU choice for new servers, the scale CLI's requests, the
rollout server metrics, address checks."""

import argparse

import pytest

from areal_mega.launch.elastic import ScaleError, free_gpus
from areal_mega.launch.scale import main as scale_main
from areal_mega.launch.scale import request_of
from areal_mega.rollout.server_pool import ServerPoolError, normalize_addr, pool_metrics


def test_free_gpus_takes_unused_gpus_in_order_and_refuses_too_few():
    assert free_gpus(8, {0, 1, 4}, 2, 2) == [(2, 3), (5, 6)]
    assert free_gpus(2, set(), 1, 2) == [(0,), (1,)]
    with pytest.raises(ScaleError, match="need 4 free GPUs; 3 free"):
        free_gpus(4, {0}, 2, 2)


def test_scale_requests():
    ns = dict(list=False, add=None, add_addr=None, remove=None, drain=False)
    assert request_of(argparse.Namespace(**{**ns, "list": True})) == {"cmd": "list"}
    assert request_of(argparse.Namespace(**{**ns, "add": 2})) == {"cmd": "add", "n": 2}
    assert request_of(argparse.Namespace(**{**ns, "add_addr": "h:1"})) == {
        "cmd": "add_addr",
        "addr": "h:1",
    }
    assert request_of(argparse.Namespace(**{**ns, "remove": "rollout1", "drain": True})) == {
        "cmd": "remove",
        "id": "rollout1",
        "drain": True,
    }


def test_scale_cli_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        scale_main(["--run-dir", str(tmp_path), "--list", "--drain"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        scale_main(["--run-dir", str(tmp_path), "--add", "0"])
    assert scale_main(["--run-dir", str(tmp_path / "nope"), "--list"]) == 2
    assert "not the run directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("name: x\n")
    assert scale_main(["--run-dir", str(tmp_path), "--list"]) == 1
    assert "no launcher is running" in capsys.readouterr().err


def test_pool_metrics_and_addresses():
    stats = {
        "live_servers": 2,
        "resumptions": 3,
        "servers": [
            {"addr": "http://10.0.0.1:30000", "requests": 5, "tokens": 40},
            {"addr": "http://h:1", "requests": 0, "tokens": 0},
        ],
    }
    assert pool_metrics(stats) == {
        "rollout/servers": 2,
        "rollout/resumptions": 3,
        "rollout/server/10_0_0_1_30000/requests": 5,
        "rollout/server/10_0_0_1_30000/tokens": 40,
        "rollout/server/h_1/requests": 0,
        "rollout/server/h_1/tokens": 0,
    }
    assert normalize_addr("h:8000") == normalize_addr("http://h:8000/") == "http://h:8000"
    for bad in ("h", "h:x", "h:0", ":80", "h:70000"):
        with pytest.raises(ServerPoolError, match="expected host:port"):
            normalize_addr(bad)

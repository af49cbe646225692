"""Issue 35 part 4: no process binds a non-loopback address without authentication, and the
Slurm script hands the rollout API key to its steps without argv. Every refusal is one error
naming the flag or key to set; nothing here listens on a public interface. (The ZMQ data plane
and control sockets are checked in test_safe_defaults.py.)"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.backends.sglang import build_sglang_command
from areal_mega.common.net import is_loopback_host
from areal_mega.config import ConfigError, load_config
from areal_mega.inference.process import LocalServerProcess
from areal_mega.launch import local
from areal_mega.security import API_KEY_ENV, API_KEY_FILE_ENV, api_key_from_env, check_bind

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes/tiny-cpu.yaml"
KEY = "key-that-must-stay-off-argv"
# a layout with the rollout server alone on node 0: what run.sbatch runs with --serve-node 0
TWO_NODES = [
    "cluster.device=cuda",
    "cluster.n_nodes=2",
    "cluster.n_gpus_per_node=1",
    "allocation=local:d1+megatron:d1",
]


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)


def test_loopback_hosts():
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "*", "10.0.0.7", "node3", ""):
        assert not is_loopback_host(host), host


def test_cpu_server_refuses_a_network_host_without_a_key(capsys):
    from areal_mega.inference.server import main

    with pytest.raises(SystemExit) as e:
        main(["--model-path", "/nonexistent", "--host", "0.0.0.0", "--port", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--host 0.0.0.0" in err and API_KEY_ENV in err and "--allow-unauthenticated" in err
    with pytest.raises(ConfigError, match="local rollout server host 10.0.0.7.*api_key"):
        LocalServerProcess("/nonexistent", port=1, host="10.0.0.7")


def test_sglang_command_refuses_a_network_host_without_a_key(tmp_path):
    assert (
        build_sglang_command("/m", 1)[build_sglang_command("/m", 1).index("--host") + 1]
        == "127.0.0.1"
    )  # the default is loopback now
    with pytest.raises(ConfigError, match="SGLang server --host 0.0.0.0.*rollout.api_key"):
        build_sglang_command("/m", 1, host="0.0.0.0")
    argv = build_sglang_command("/m", 1, host="0.0.0.0", api_key_file=tmp_path / "k.yaml")
    assert "--config" in argv


def test_serve_node_requires_the_key_or_the_logged_opt_out(tmp_path, capsys, caplog):
    args = ["--config", str(TINY), "--serve-node", "0", f"logging.run_dir={tmp_path}", *TWO_NODES]
    assert local.main(args) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert "launch.local --serve-node 0" in err and "rollout.api_key" in err
    assert API_KEY_FILE_ENV in err and "rollout.allow_unauthenticated" in err
    assert not (tmp_path / "logs").exists()
    # the servers it would start serve the network, with the key or the opt-out on their argv
    cfg = load_config(
        TINY, [f"logging.run_dir={tmp_path}", *TWO_NODES, "rollout.allow_unauthenticated=true"]
    )
    argv = local.server_command(cfg, local.planned_layout(cfg).servers[0], "0.0.0.0")
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and "--allow-unauthenticated" in argv
    with caplog.at_level(logging.WARNING, logger="areal_mega.security"):
        check_bind("0.0.0.0", authenticated=False, what="x", fix="y", allow_unauthenticated=True)
    assert "WITHOUT authentication" in caplog.text


def test_api_key_comes_from_a_private_file(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=f"{API_KEY_FILE_ENV}=.*0644.*chmod 600"):
        api_key_from_env({API_KEY_FILE_ENV: str(path)})
    path.chmod(0o600)
    monkeypatch.setenv(API_KEY_FILE_ENV, str(path))
    assert load_config(TINY).rollout.api_key == KEY
    assert load_config(TINY, ["rollout.api_key=other"]).rollout.api_key == "other"


def _sbatch(tmp_path, *overrides, key_file=None):
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'nodeA\\nnodeB\\n'\n")
    (stubs / "srun").write_text(
        '#!/usr/bin/env bash\necho "SRUN key_file='
        '${AREAL_ROLLOUT_API_KEY_FILE:-} $*" >> "$STUB_LOG"\n'
    )
    (stubs / "curl").write_text("#!/usr/bin/env bash\nexit 0\n")
    for f in stubs.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "SLURM_JOB_NODELIST": "node[A-B]",
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "STUB_LOG": str(tmp_path / "stub.log"),
    }
    if key_file:
        env[API_KEY_FILE_ENV] = str(key_file)
    return subprocess.run(
        [
            "bash",
            str(ROOT / "launch/slurm/run.sbatch"),
            str(TINY),
            f"logging.run_dir={tmp_path / 'run'}",
            *TWO_NODES,
            *overrides,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sbatch_passes_the_key_file_to_every_step_and_refuses_it_in_argv(tmp_path, capsys):
    from areal_mega.launch.slurm_submit import main as submit

    assert submit(["--dry-run", str(TINY), f"rollout.api_key={KEY}"]) == 2
    assert API_KEY_FILE_ENV in capsys.readouterr().err
    r = _sbatch(tmp_path, f"rollout.api_key={KEY}")
    assert r.returncode == 2 and API_KEY_FILE_ENV in r.stderr
    assert not (tmp_path / "stub.log").exists()  # no step started
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    r = _sbatch(tmp_path, key_file=key_file)
    log = (tmp_path / "stub.log").read_text()
    assert r.returncode == 0, r.stdout + r.stderr + log
    steps = log.splitlines()
    assert any("--serve-node" in s for s in steps) and any("torchrun.sh" in s for s in steps)
    assert all(s.startswith(f"SRUN key_file={key_file} ") for s in steps), steps
    assert KEY not in log + r.stdout + r.stderr


def test_online_gateway_beyond_loopback_needs_an_admin_key_and_tls_or_the_opt_out():
    on = ["rollout.workflow=online"]
    assert load_config(str(TINY), on).rollout.online.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="rollout.online.admin_api_key"):
        load_config(str(TINY), on + ["rollout.online.host=0.0.0.0"])
    with pytest.raises(
        ConfigError, match="tls_cert and rollout.online.tls_key.*allow_insecure_http"
    ):
        load_config(
            str(TINY), on + ["rollout.online.host=0.0.0.0", "rollout.online.admin_api_key=k"]
        )
    for extra in (
        ["rollout.online.allow_insecure_http=true"],
        ["rollout.online.tls_cert=c.pem", "rollout.online.tls_key=k.pem"],
    ):
        cfg = load_config(
            str(TINY),
            on + ["rollout.online.host=0.0.0.0", "rollout.online.admin_api_key=k", *extra],
        )
    # the admin key is a secret: the resolved config file is private, trackers see none
    from areal_mega.config import config_to_dict
    from areal_mega.security import holds_secret, redact_secrets

    tree = config_to_dict(cfg)
    assert holds_secret(tree) and not holds_secret(config_to_dict(load_config(str(TINY), on)))
    assert redact_secrets(tree)["rollout"]["online"]["admin_api_key"] == "<redacted>"
    with pytest.raises(ConfigError, match="go together"):
        load_config(str(TINY), on + ["rollout.online.tls_cert=c.pem"])

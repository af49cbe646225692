"""Issue 21 items 13-14: nothing unauthenticated on the network, no secret readable by others.

Real sockets, real files, a real server process; no mocks. Every bind that would reach beyond
loopback is one that must be refused, so nothing here listens on a public interface.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
import zmq

from areal_mega.config import ConfigError, load_config
from areal_mega.dataplane.control import ControlError, ControlServer, RolloutLink
from areal_mega.dataplane.transport import DataplaneError, TrajectoryReceiver
from areal_mega.launch import local
from areal_mega.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes/tiny-cpu.yaml"
SECRET = "s3cret-for-tests"
KEY = "api-key-that-must-not-show-in-ps"

pytestmark = pytest.mark.timeout(600)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ----------------------------------------------------------------------- item 13: data plane


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://[::]:0"])
def test_receiver_refuses_a_remote_bind_without_secret(endpoint):
    with pytest.raises(DataplaneError, match="without a shared secret"):
        TrajectoryReceiver(endpoint, allow_remote=True)
    with pytest.raises(DataplaneError, match="without a shared secret"):
        TrajectoryReceiver(endpoint, secret="", allow_remote=True)  # empty = no secret


def test_receiver_on_loopback_needs_no_secret():
    from areal_mega.dataplane.transport import is_local_endpoint

    with TrajectoryReceiver("tcp://127.0.0.1:0", allow_remote=True) as rx:
        assert rx.endpoint.startswith("tcp://127.0.0.1:")
    assert is_local_endpoint("ipc:///tmp/x.sock") and is_local_endpoint("tcp://[::1]:5")
    assert not is_local_endpoint("tcp://0.0.0.0:5") and not is_local_endpoint("tcp://node3:5")


def test_config_allow_remote_without_secret_names_both_keys():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["dataplane.allow_remote=true"])
    assert "dataplane.allow_remote" in str(e.value) and "dataplane.secret" in str(e.value)
    cfg = load_config(TINY, ["dataplane.allow_remote=true", f"dataplane.secret={SECRET}"])
    assert cfg.dataplane.allow_remote and cfg.dataplane.secret == SECRET


# ----------------------------------------------------------------------- item 13: control


class _Handler:
    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, msg):
        with self.lock:
            self.calls.append(dict(msg))
        return {"echo": msg["cmd"]}


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:0", "tcp://*:0"])
def test_control_server_refuses_a_remote_bind_without_secret(endpoint):
    with pytest.raises(ControlError, match="dataplane.secret"):
        ControlServer(endpoint, _Handler(), allow_remote=True)
    with pytest.raises(ControlError, match="allow_remote"):
        ControlServer(endpoint, _Handler(), secret=SECRET)


def test_control_rejects_missing_and_wrong_secret_and_accepts_the_right_one():
    h = _Handler()
    srv = ControlServer("tcp://127.0.0.1:0", h, secret=SECRET).start()
    links = []
    try:
        plain = RolloutLink(srv.endpoint, timeout_s=60)
        links.append(plain)
        with pytest.raises(ControlError, match="missing_mac"):
            plain.request({"cmd": "ping"})
        wrong = RolloutLink(srv.endpoint, secret="not-the-secret", timeout_s=60)
        links.append(wrong)
        with pytest.raises(ControlError, match="bad_mac"):
            wrong.request({"cmd": "ping"})
        assert h.calls == []  # neither reached the worker's handler
        assert srv.rejected["missing_mac"] == 1 and srv.rejected["bad_mac"] == 1
        good = RolloutLink(srv.endpoint, secret=SECRET, timeout_s=60)
        links.append(good)
        assert good.request({"cmd": "ping"})["echo"] == "ping"
        assert good.update_weights(version=3, path="/w")["echo"] == "update_weights"
        assert h.calls == [{"cmd": "ping"}, {"cmd": "update_weights", "version": 3, "path": "/w"}]
        assert srv.rejected["replay"] == 0
    finally:
        for link in links:
            link.close()
        srv.close()


def test_control_server_closed_mid_command_answers_and_then_closes(monkeypatch):
    """``close`` while a command runs past its 2 s join: the serving thread still answers
    (no send on a socket closed under it) and closes the socket itself."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    started = threading.Event()

    def slow(msg):
        started.set()
        time.sleep(3)
        return {"echo": msg["cmd"]}

    srv = ControlServer("tcp://127.0.0.1:0", slow, secret=SECRET).start()
    link = RolloutLink(srv.endpoint, secret=SECRET, timeout_s=60)
    replies = []
    asker = threading.Thread(target=lambda: replies.append(link.request({"cmd": "drain"})))
    try:
        asker.start()
        assert started.wait(30)
        srv.close()
        asker.join(30)
        srv._thread.join(30)
    finally:
        link.close()
    assert replies and replies[0]["echo"] == "drain"
    assert not srv._thread.is_alive() and srv._sock.closed and errors == []


def _raw_request(sock, frames):
    sock.send_multipart(frames)
    assert sock.poll(60_000, zmq.POLLIN), "no reply from the control server"
    return sock.recv_multipart()


def test_control_refuses_a_replayed_request():
    from areal_mega.dataplane.control import _REQ_TAG, _mac

    h = _Handler()
    srv = ControlServer("tcp://127.0.0.1:0", h, secret=SECRET).start()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.endpoint)
    key = SECRET.encode()
    try:
        first = json.dumps({"cmd": "ping", "_id": "a", "_nonce": None}).encode()
        reply = json.loads(_raw_request(sock, [first, _mac(key, _REQ_TAG, first)])[0])
        assert reply["ok"] is False and reply["_stale"] and h.calls == []
        body = json.dumps(
            {"cmd": "end_update", "version": 7, "_id": "b", "_nonce": reply["_nonce"]}
        ).encode()
        signed = [body, _mac(key, _REQ_TAG, body)]
        assert json.loads(_raw_request(sock, signed)[0])["ok"] is True
        assert len(h.calls) == 1
        again = json.loads(_raw_request(sock, signed)[0])  # the same signed bytes, replayed
        assert again["ok"] is False and "replayed" in again["error"]
        assert len(h.calls) == 1 and srv.rejected["replay"] == 1
    finally:
        sock.close(0)
        srv.close()


def test_signed_client_refuses_an_unsigned_worker():
    srv = ControlServer("tcp://127.0.0.1:0", _Handler()).start()  # no secret on the worker
    link = RolloutLink(srv.endpoint, secret=SECRET, timeout_s=60)
    try:
        with pytest.raises(ControlError, match="not signed"):
            link.request({"cmd": "ping"})
    finally:
        link.close()
        srv.close()


# ----------------------------------------------------------------------- item 14: files


def _cfg(tmp_path, *extra):
    return load_config(
        TINY, [f"logging.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", *extra]
    )


def test_launcher_config_yaml_is_private_when_it_holds_a_secret(tmp_path):
    cfg = _cfg(tmp_path, f"dataplane.secret={SECRET}", f"rollout.api_key={KEY}")
    path = RunDir.from_config(cfg).config_file
    path.parent.mkdir(parents=True)
    path.write_text("old: world-readable\n")
    path.chmod(0o644)
    local.build_specs(cfg, "cpu")
    assert _mode(path) == 0o600
    written = yaml.safe_load(path.read_text())
    assert written["dataplane"]["secret"] == SECRET and written["rollout"]["api_key"] == KEY
    assert not any(p.name.endswith(".tmp") for p in path.parent.iterdir())


def test_launcher_config_yaml_without_secret_follows_the_umask(tmp_path):
    cfg = _cfg(tmp_path)
    local.build_specs(cfg, "cpu")
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(RunDir.from_config(cfg).config_file) == 0o666 & ~umask


def test_trainer_resolved_config_is_private_when_it_holds_a_secret(tmp_path):
    from areal_mega.train.session import TrainerSession

    for extra in ([f"dataplane.secret={SECRET}"], [f"rollout.api_key={KEY}"]):
        cfg = _cfg(tmp_path, *extra)
        paths = RunDir.from_config(cfg)
        paths.root.mkdir(parents=True, exist_ok=True)
        if paths.resolved_config_file.exists():
            paths.resolved_config_file.chmod(0o644)
        TrainerSession._write_resolved_config(SimpleNamespace(cfg=cfg, paths=paths))
        assert _mode(paths.resolved_config_file) == 0o600
        assert json.loads(paths.resolved_config_file.read_text())["name"] == cfg.name


# ----------------------------------------------------------------------- item 14: argv


def test_sglang_command_takes_the_key_from_a_private_file(tmp_path):
    cfg = load_config(
        ROOT / "recipes/qwen2.5-32b-math.yaml",
        [f"rollout.api_key={KEY}", f"logging.run_dir={tmp_path / 'run'}"],
    )
    assert local.server_secrets(cfg) == {}
    key_file = RunDir.from_config(cfg).sglang_key_file
    assert _mode(key_file) == 0o600 and yaml.safe_load(key_file.read_text()) == {"api-key": KEY}
    argv = local.server_command(cfg, local.planned_layout(cfg).servers[0], "127.0.0.1")
    assert KEY not in " ".join(argv) and "--api-key" not in argv
    assert argv[argv.index("--config") + 1] == str(key_file)


def _get(url, key=None):
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def test_launched_local_server_keeps_the_key_off_its_command_line(tmp_path):
    from areal_mega.models.tiny import make_tiny_model

    make_tiny_model(tmp_path / "model", arch="llama", hidden_size=32, num_layers=1, seed=0)
    cfg = _cfg(tmp_path, f"rollout.api_key={KEY}")
    specs, layout = local.build_specs(cfg, "cpu")
    spec = next(s for s in specs if s.name == "rollout0")
    assert KEY not in " ".join(map(str, spec.argv))
    env = dict(os.environ, **{k: str(v) for k, v in (spec.env or {}).items()})
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [str(a) for a in spec.argv], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{layout.servers[0].port}/health"
    try:
        deadline = time.monotonic() + 300
        status = None
        while status != 200 and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            status = _get(url, KEY)
            if status != 200:
                time.sleep(0.2)  # poll interval, not a threshold
        assert status == 200, (tmp_path / "server.log").read_text()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert KEY not in cmdline and "areal_mega.inference.server" in cmdline
        info = url.replace("/health", "/get_model_info")  # /health needs no key (SGLang)
        assert _get(info, KEY) == 200
        assert _get(info) == 401  # the key is still enforced
        assert _get(info, "wrong-key") == 401
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

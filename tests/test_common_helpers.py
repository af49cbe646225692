"""areal_mega.common: atomic file writes, free ports, readiness probes, object loading (real
files and sockets, nothing mocked)."""

from __future__ import annotations

import ast
import http.server
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from areal_mega.common.files import atomic_open, atomic_write, fsync_path
from areal_mega.common.net import (
    LOWEST_PICKED_PORT,
    PORT_CLAIM_S,
    claim_port,
    ephemeral_port_range,
    free_port,
    free_ports,
    http_ready,
    quiet_ports,
    tcp_ready,
)

ROOT = Path(__file__).resolve().parents[1]


def _names(d) -> set:
    return set(os.listdir(d))


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_replaces_content_and_leaves_no_temp(tmp_path, durable):
    p = tmp_path / "state.json"
    p.write_text("old")
    assert atomic_write(p, "new ü", durable=durable) == p
    assert p.read_text(encoding="utf-8") == "new ü"
    atomic_write(p, b"\x00\x01bytes", durable=durable)
    assert p.read_bytes() == b"\x00\x01bytes"
    assert _names(tmp_path) == {"state.json"}


def test_atomic_write_creates_a_missing_file(tmp_path):
    atomic_write(tmp_path / "fresh", "x", durable=True)
    assert (tmp_path / "fresh").read_text() == "x"
    assert _names(tmp_path) == {"fresh"}


@pytest.mark.parametrize("durable", [True, False])
def test_failure_midway_keeps_old_content_and_removes_temp(tmp_path, durable):
    p = tmp_path / "buffer.bin"
    p.write_bytes(b"old content")

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with atomic_open(p, "wb", durable=durable) as f:
            f.write(b"half of the new")
            f.flush()
            # the half-written temp file sits next to the target, the target is untouched
            assert len(_names(tmp_path)) == 2 and p.read_bytes() == b"old content"
            raise Boom()
    assert p.read_bytes() == b"old content"
    assert _names(tmp_path) == {"buffer.bin"}


def test_failing_write_of_a_str_keeps_old_content(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("old")
    with pytest.raises(TypeError):
        atomic_write(p, ["not", "bytes"], durable=False)  # f.write raises inside the helper
    assert p.read_text() == "old"
    assert _names(tmp_path) == {"t.txt"}


def test_private_mode_is_0600_whatever_the_umask_and_replaces_a_readable_file(tmp_path):
    p = tmp_path / "secret.yaml"
    p.write_text("public")
    os.chmod(p, 0o644)
    old = os.umask(0)  # the most permissive umask: the mode must still be exactly 0600
    try:
        atomic_write(p, "api-key: k", durable=True, mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert p.read_text() == "api-key: k"


def test_private_mode_is_set_before_anything_is_written(tmp_path):
    p = tmp_path / "secret"
    with atomic_open(p, "w", durable=True, file_mode=0o600) as f:
        tmp = [n for n in _names(tmp_path) if n.endswith(".tmp")]
        assert len(tmp) == 1
        assert stat.S_IMODE((tmp_path / tmp[0]).stat().st_mode) == 0o600
        f.write("k")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_default_mode_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "f", "x", durable=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o640


def test_atomic_open_refuses_append_and_read_modes(tmp_path):
    for mode in ("a", "r", "r+b"):
        with pytest.raises(ValueError, match="whole file"):
            with atomic_open(tmp_path / "f", mode, durable=False):
                pass
    assert _names(tmp_path) == set()


def test_fsync_path_takes_files_and_directories(tmp_path):
    (tmp_path / "f").write_text("x")
    fsync_path(tmp_path / "f")
    fsync_path(tmp_path)


# ----------------------------------------------------------------------------------- ports
def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(8)
    assert len(ports) == 8 and len(set(ports)) == 8
    socks = []
    try:
        for p in ports:  # every one at the same time
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
            s.listen()
    finally:
        for s in socks:
            s.close()
    assert free_ports(0) == []


def test_free_ports_avoid_the_kernels_ephemeral_range(tmp_path):
    eph = ephemeral_port_range()
    if eph is not None:  # Linux: outgoing connections never take these before their user
        low, high = eph
        assert all(not low <= p <= high and p >= LOWEST_PICKED_PORT for p in free_ports(20))
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ephemeral_port_range(str(f)) == (32768, 60999)
    f.write_text("garbage")
    assert ephemeral_port_range(str(f)) is None
    assert ephemeral_port_range(str(tmp_path / "missing")) is None


def test_a_claimed_port_is_not_handed_out_again_until_its_claim_expires(tmp_path):
    claims = str(tmp_path / "claims")
    assert claim_port(20001, claims, now=1000.0)
    assert not claim_port(20001, claims, now=1000.0 + PORT_CLAIM_S - 1)  # another caller's
    assert claim_port(20001, claims, now=1000.0 + PORT_CLAIM_S + 1)  # expired: taken over
    assert not claim_port(20001, claims, now=1000.0 + PORT_CLAIM_S + 2)
    (tmp_path / "file").write_text("x")
    assert claim_port(20002, str(tmp_path / "file" / "sub"))  # unwritable: best effort


def test_two_processes_picking_at_once_never_get_the_same_port(tmp_path):
    """Two launchers (or a test run's two workers) drawing 400 ports each at the same moment:
    drawn independently from ~27,000 ports they would share about 6; claimed, none."""
    code = (
        "import json; from areal_mega.common.net import free_ports; "
        "print(json.dumps(free_ports(400)))"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    picks = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(len(set(p)) == 400 for p in picks)
    assert not set(picks[0]) & set(picks[1])
    assert len(os.listdir(tmp_path / f"areal-mega-ports-{os.getuid()}")) >= 800


def test_quiet_ports_lie_outside_the_ephemeral_range():
    ports = quiet_ports((32768, 60999))
    assert ports[0] == LOWEST_PICKED_PORT and 32767 in ports and 61000 in ports
    assert 32768 not in ports and 60999 not in ports and ports[-1] == 65535
    assert quiet_ports(None) == []  # unknown: the OS picks
    assert quiet_ports((1024, 65000)) == []  # too few left to draw from
    assert len(quiet_ports((64000, 65535))) == 64000 - LOWEST_PICKED_PORT


def test_free_port_is_bindable_on_the_given_host():
    p = free_port("127.0.0.1")
    assert 0 < p < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


# ---------------------------------------------------------------------------------- probes
def test_tcp_ready_true_with_a_listener_false_without():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        assert tcp_ready("127.0.0.1", port)() is True
    assert tcp_ready("127.0.0.1", port, timeout=0.5)() is False


class _Handler(http.server.BaseHTTPRequestHandler):
    """``/ok`` answers 200, ``/loading`` 503, ``/missing`` 404; ``/secret`` 200 only with the
    bearer key, else 401."""

    def do_GET(self):
        code = {"/ok": 200, "/loading": 503, "/missing": 404}.get(self.path)
        if self.path == "/secret":
            code = 200 if self.headers.get("Authorization") == "Bearer k3y" else 401
        self.send_response(code or 500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def http_base():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


def test_http_ready_against_a_real_server(http_base):
    assert http_ready(f"{http_base}/ok")()
    assert http_ready(f"{http_base}/missing")()  # up: any status below 500
    assert not http_ready(f"{http_base}/loading")()  # 503 while loading: not yet
    assert http_ready(f"{http_base}/ok", healthy=True)()
    assert not http_ready(f"{http_base}/missing", healthy=True)()
    assert http_ready(f"{http_base}/secret", api_key="k3y", healthy=True)()
    assert not http_ready(f"{http_base}/secret", api_key="wrong", healthy=True)()
    assert not http_ready(f"{http_base}/secret", healthy=True)()


def test_http_ready_false_when_nothing_listens_or_the_url_is_bad():
    port = free_port()
    assert not http_ready(f"http://127.0.0.1:{port}/health", timeout=0.5)()
    with pytest.raises(ValueError):
        http_ready("not a url")


def test_common_imports_nothing_else_from_areal_mega():
    pkg = Path(__file__).resolve().parents[1] / "areal_mega" / "common"
    for f in sorted(pkg.glob("*.py")):
        tree = ast.parse(f.read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {
            n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
        }
        assert not {m for m in mods if m.split(".")[0] == "areal_mega"}, (f.name, mods)


def test_load_object_by_module_or_file_and_errors_name_the_key(tmp_path):
    from areal_mega.common.loading import load_object
    from areal_mega.rewards import gsm8k_reward

    assert load_object("areal_mega.rewards:gsm8k_reward", "rollout.reward_fn") is gsm8k_reward
    f = tmp_path / "my_reward.py"
    f.write_text("def score(prompt, completion, answer, **kw):\n    return 0.5\n")
    assert load_object(f"{f}:score", "rollout.reward_fn")("p", "c", "a") == 0.5
    with pytest.raises(ValueError, match=r"rollout.reward_fn='areal_mega.rewards.gsm8k_reward'"):
        load_object("areal_mega.rewards.gsm8k_reward", "rollout.reward_fn")  # dotted: opt-in
    assert load_object("areal_mega.rewards.gsm8k_reward", "x", dotted_ok=True) is gsm8k_reward
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RuntimeError, match="boom"):
        load_object(f"{broken}:x", "rollout.workflow")
    assert not any(m.startswith("_areal_user_broken_") for m in sys.modules)  # none left behind


@pytest.mark.parametrize(
    "old,new",
    [
        ("areal_mega.rollout.rewards:math_reward", "areal_mega.rewards:math_reward"),
        ("areal_mega.data.synthetic:exact_match_reward", "areal_mega.rewards:exact_match_reward"),
        (
            "areal_mega.rollout.agents:ExternalAgent",
            "areal_mega.workflow.external_agent:ExternalAgent",
        ),
        ("areal_mega.rollout.workflows:RLVRWorkflow", "areal_mega.workflow.builtin:RLVRWorkflow"),
    ],
)
def test_moved_names_still_load_with_a_warning_naming_the_new_one(old, new):
    from areal_mega.common.loading import load_object

    with pytest.warns(FutureWarning, match=re.escape(new)):
        got = load_object(old, "rollout.reward_fn")
    assert got is load_object(new, "rollout.reward_fn")


def test_recipes_name_objects_that_load_without_a_moved_alias():
    """Every ``reward_fn`` / ``workflow`` path in recipes/ and examples/ loads under its
    current name (the alias table is for users' own configs, not ours)."""
    import warnings

    import yaml

    from areal_mega.common.loading import load_object

    root = Path(__file__).resolve().parents[1]
    specs = []
    for f in sorted([*root.glob("recipes/*.yaml"), *root.glob("examples/*/*.yaml")]):
        rollout = (yaml.safe_load(f.read_text()) or {}).get("rollout") or {}
        specs += [
            (f.name, rollout[k])
            for k in ("reward_fn", "workflow")
            if ":" in str(rollout.get(k, "")) and ".py:" not in str(rollout[k])
        ]
    assert len(specs) >= 5, specs
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for name, spec in specs:
            assert load_object(spec, f"{name}: rollout") is not None

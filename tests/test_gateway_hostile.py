"""The online gateway under hostile clients, as a real process whose file descriptor limit is
low (``tests/helpers/gateway_fd_limit_worker.py``): ~1,100 idle, half-sent and body-less sockets
from one
attacker do not lock a legitimate agent out (served within seconds), the gateway writes no
traceback per socket and closes the idle ones itself; hostile bodies (too big, nested too
deep, numbers out of range) are 4xx, never 500. Connections go to 127.0.0.1 only."""

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.workers import worker_cmd, worker_env

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
NOFILE = 256  # the gateway's own limit: far fewer than the attacker's sockets
ATTACK = 1100
IDLE_S = 2.0


def post(url, path, body, key, timeout=30):
    """``(status, JSON answer)`` of a POST of ``body`` (bytes as they are)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = urllib.request.Request(
        url + path,
        data=data,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


@pytest.fixture()
def gateway(tmp_path):
    cfg = {"idle_timeout_s": IDLE_S, "body_timeout_s": IDLE_S, "max_open_sessions": 1024}
    err = open(tmp_path / "stderr.log", "w+b")
    proc = subprocess.Popen(
        worker_cmd("gateway_fd_limit_worker", tmp_path / "run", NOFILE, json.dumps(cfg)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        env=worker_env(),
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "stderr.log").read_text()
        info = json.loads(line)
        yield {**info, "proc": proc, "stderr": tmp_path / "stderr.log"}
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        err.close()


def test_a_socket_flood_does_not_lock_out_an_agent(gateway):
    url, admin = gateway["base_url"], gateway["admin_api_key"]
    host, port = url[len("http://") :].rsplit(":", 1)
    assert host == "127.0.0.1"
    t0 = time.monotonic()
    assert post(url, "/rl/start_session", {"task_id": "t"}, admin)[0] == 200
    quiet_s = time.monotonic() - t0
    socks, failed = [], 0
    t_attack = time.monotonic()
    for i in range(ATTACK):  # idle, headers cut short, a body that never comes
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((host, int(port)))
            if i % 3 == 1:
                s.sendall(b"POST /rl/start_session HTTP/1.1\r\nHost: x\r\n")
            elif i % 3 == 2:
                s.sendall(
                    b"POST /rl/start_session HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
                )
        except OSError:
            failed += 1
            s.close()
            continue
        socks.append(s)
    attack_s = time.monotonic() - t_attack
    t0 = time.monotonic()
    st, ans = post(url, "/rl/start_session", {"task_id": "t"}, admin, timeout=20)
    served_s = time.monotonic() - t0
    assert st == 200 and ans["session_id"].startswith("sess-"), ans
    # every attacking socket is closed by the gateway within its idle limit
    deadline = time.monotonic() + 3 * IDLE_S + 10
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        still = []
        for s in open_:
            s.settimeout(0.001)
            try:
                if s.recv(65536) == b"":
                    continue  # closed by the gateway
            except (ConnectionResetError, BrokenPipeError):
                continue
            except OSError:
                pass  # nothing yet
            still.append(s)
        open_ = still
        time.sleep(0.2)
    for s in socks:
        s.close()
    assert open_ == []
    st, _ = post(url, "/rl/start_session", {"task_id": "t"}, admin, timeout=20)
    assert st == 200
    gateway["proc"].stdin.close()
    gateway["proc"].wait(30)
    counts = json.loads(gateway["proc"].stdout.readlines()[-1])
    log = gateway["stderr"].read_bytes()
    assert log.count(b"Traceback") == 0 and len(log) < 20_000, log[-3000:]
    print(
        f"\n{ATTACK} sockets opened in {attack_s:.2f} s ({failed} not connected), gateway "
        f"limit {NOFILE} fds: agent served in {served_s:.2f} s under attack ({quiet_s:.2f} s "
        f"before it); counters {counts}"
    )
    assert served_s < 10


def test_hostile_bodies_are_4xx(gateway):
    url, admin = gateway["base_url"], gateway["admin_api_key"]
    st, sess = post(url, "/rl/start_session", {"task_id": "t"}, admin)
    assert st == 200
    key, sid = sess["api_key"], sess["session_id"]
    deep = b"[" * 100_000 + b"]" * 100_000
    cases = [
        ("/rl/start_session", admin, b'{"task_id": "t", "x": ' + deep + b"}", 400),
        ("/rl/start_session", admin, b'{"task_id": ' + b"1" + b"0" * 400 + b"}", 400),
        (
            "/rl/set_reward",
            admin,
            b'{"session_id": "%s", "reward": 1%s}' % (sid.encode(), b"0" * 400),
            400,
        ),
        ("/rl/set_reward", admin, b'{"session_id": "%s", "reward": 1e400}' % sid.encode(), 422),
        (
            "/v1/chat/completions",
            key,
            b'{"model": "policy", "messages": [{"role": "user", '
            b'"content": "x"}], "max_tokens": 1' + b"0" * 400 + b"}",
            400,
        ),
        ("/v1/completions", key, b'{"model": "policy", "prompt": ' + deep + b"}", 400),
        ("/rl/start_session", admin, b'{"task_id": "' + b"a" * (65 << 20) + b'"}', 413),
    ]
    for path, k, body, status in cases:
        st, ans = post(url, path, body, k)
        assert st == status, (path, body[:80], st, ans)
        assert isinstance(ans, dict) and ans["error"]["message"], ans
    st, _ = post(url, "/rl/start_session", {"task_id": "t"}, admin)  # still serving
    assert st == 200
    assert gateway["stderr"].read_bytes().count(b"Traceback") == 0


def test_a_completion_whose_client_hung_up_is_not_trained(server, models, tmp_path):
    """An agent that hangs up in the middle of a generation (the openai SDK's timeout, then its
    retry) never received that completion: it is not trained; what the agent received is."""
    import openai
    from transformers import AutoTokenizer

    from areal_mega.common import counters
    from areal_mega.config import OnlineConfig
    from areal_mega.workflow.api import WorkflowSettings
    from areal_mega.workflow.online_gateway import INFO_FILE, OnlineWorkflow
    from tests.helpers.rollout import GroupSink
    from tests.test_openai_endpoint import HERMES_TEMPLATE, NO_SPECIAL, controller, wait_for

    tok = AutoTokenizer.from_pretrained(models["a"])
    tok.chat_template = HERMES_TEMPLATE
    wf = OnlineWorkflow(OnlineConfig(), n_samples=1, run_dir=str(tmp_path))
    wf.settings = WorkflowSettings(max_new_tokens=300)
    sink = GroupSink()
    ctl = controller(server.addr, wf, tok, sink, n_prompts=4, batch_size=1, n_samples=1).start()
    try:
        wait_for(lambda: (tmp_path / INFO_FILE).exists() and wf.book.free_slots)
        info = json.loads((tmp_path / INFO_FILE).read_text())
        url, admin = info["base_url"], info["admin_api_key"]
        st, sess = post(url, "/rl/start_session", {"task_id": "t"}, admin)
        assert st == 200
        before = counters.snapshot().get("online/completions_abandoned", 0)
        body = json.dumps(
            {
                "model": "policy",
                "max_tokens": 300,
                "logit_bias": NO_SPECIAL,
                "messages": [{"role": "user", "content": "hang up"}],
            }
        ).encode()
        host, port = url[len("http://") :].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nAuthorization: Bearer "
            + sess["api_key"].encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        wait_for(lambda: ctl.n_inflight_requests >= 1)
        s.close()  # gone before the answer
        wait_for(lambda: counters.snapshot().get("online/completions_abandoned", 0) > before)
        c = openai.OpenAI(
            base_url=sess["base_url"], api_key=sess["api_key"], max_retries=0, timeout=120
        )
        ans = c.chat.completions.create(
            model="policy",
            max_tokens=5,
            logprobs=True,
            messages=[{"role": "user", "content": "stay"}],
            logit_bias=NO_SPECIAL,
        )
        sid, key = sess["session_id"], sess["api_key"]
        assert post(url, "/rl/end_session", {"session_id": sid}, key)[0] == 200
        assert post(url, "/rl/set_reward", {"session_id": sid, "reward": 1.0}, key)[0] == 200
        (group,) = sink.take(ctl, 1, timeout=120)
    finally:
        ctl.stop()
    (t,) = group
    got = t.logprobs[t.loss_mask.astype(bool)].tolist()
    assert len(got) == 5
    assert got == pytest.approx([x.logprob for x in ans.choices[0].logprobs.content], abs=0)

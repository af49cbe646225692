"""Issue 21 items 8-12: one bad request or client must not hurt the others (CPU rollout server).

Real server processes on a real tiny HF model, real sockets on 127.0.0.1; no mocks and no timing
thresholds (every wait is a bounded poll for a condition)."""

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from areal_mega.common.net import free_port
from areal_mega.inference.process import LocalServerProcess, launch_local_servers
from areal_mega.inference.sampling import SamplingParams, choose_tokens_isolated
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.rollout import API_KEY

pytestmark = pytest.mark.timeout(600)

IDLE_S = 2  # the server's --idle-timeout in this module
LONG = 1800  # max_new_tokens of the requests whose clients disconnect (context is 2048)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("iso") / "m",
        arch="llama",
        hidden_size=64,
        num_layers=2,
        seed=0,
        max_position_embeddings=2048,
    )


@pytest.fixture(scope="module")
def server(model):
    (p,) = launch_local_servers(
        str(model), 1, api_key=API_KEY, extra_args=["--idle-timeout", str(IDLE_S)]
    )
    try:
        yield p
    finally:
        p.stop()


def call(server, path, body=None, data=None, timeout=120):
    """(status, parsed JSON) of one request; ``data`` sends raw bytes."""
    if data is None and body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{server.addr}{path}",
        data=data,
        method="POST" if data is not None else "GET",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def info(server) -> dict:
    status, body = call(server, "/get_server_info")
    assert status == 200, body
    return body


def poll(cond, what: str, timeout: float = 120.0):
    """Wait (bounded) until ``cond()`` is truthy and return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout}s: {what}")


def gen(ids, max_new, **sp):
    return {
        "input_ids": ids,
        "sampling_params": dict(max_new_tokens=max_new, ignore_eos=True, **sp),
    }


# ------------------------------------------------------------------ item 8: sampling errors


def _row(**kw):
    return SimpleNamespace(params=SamplingParams(**kw), output_ids=[], generator=None)


def test_choose_tokens_isolated_fails_only_the_bad_rows():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]] * 4)
    rows = [
        _row(temperature=1.0),
        _row(temperature=0.5, logit_bias={1: 3e38}),
        _row(temperature=0.0),
        _row(temperature=1.0),
    ]
    rows[3].generator = "not a generator"  # sampling this row alone raises
    toks, lps, _, errors = choose_tokens_isolated(rows, logits, frozenset())
    assert errors[0] is None and toks[0] in (0, 1, 2, 3) and math.isfinite(lps[0])
    assert "NaN or infinity" in errors[1] and toks[1] is None
    assert errors[2] is None and toks[2] == 2
    assert errors[3].startswith("sampling error: TypeError") and toks[3] is None


def test_non_finite_float_params_are_400_naming_the_field(server):
    fields = [
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    ]
    for field in fields:
        for bad in ("NaN", "Infinity", "-Infinity"):
            data = ('{"input_ids": [5, 6], "sampling_params": {"%s": %s}}' % (field, bad)).encode()
            status, body = call(server, "/generate", data=data)
            assert status == 400, (field, bad, body)
            assert f"sampling_params.{field}" in body["error"]["message"], body
            assert body["error"]["code"] == 400
    status, body = call(
        server,
        "/generate",
        data=b'{"input_ids": [5], "sampling_params": {"logit_bias": {"3": NaN}}}',
    )
    assert status == 400 and "logit_bias" in body["error"]["message"], body


def test_a_row_that_cannot_be_sampled_fails_alone_in_its_batch(server):
    """Eight good requests and one whose logits overflow (a huge logit_bias at temperature
    0.5) are admitted in ONE prefill batch (queued while paused, then continued): the bad one
    ends with an abort naming the sampling error, the good ones run to their length."""
    before = info(server)
    assert call(server, "/pause_generation", {})[0] == 200
    bodies = [gen([9, 10, 11], 24, temperature=1.0) for _ in range(8)]
    bodies.insert(3, gen([9, 10, 11], 24, temperature=0.5, logit_bias={"7": 3e38}))
    try:
        with ThreadPoolExecutor(len(bodies)) as ex:
            futs = [ex.submit(call, server, "/generate", b) for b in bodies]
            poll(lambda: info(server)["num_waiting"] == len(bodies), "all requests queued")
            assert call(server, "/continue_generation", {})[0] == 200
            results = [f.result() for f in futs]
    finally:
        call(server, "/continue_generation", {})
    assert all(status == 200 for status, _ in results), results
    bad = results.pop(3)[1]
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert "sampling error" in bad["meta_info"]["finish_reason"]["message"]
    for _, out in results:
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(out["output_ids"]) == 24
    after = info(server)
    assert after["sampling_errors"] == before.get("sampling_errors", 0) + 1


# ------------------------------------------------------------------ item 9: ranges, nesting


def test_out_of_range_ints_and_deep_json_are_400(server):
    cases = [
        (gen([5], 4, sampling_seed=10**30), "sampling_seed"),
        (gen([5], 4, sampling_seed=-1), "sampling_seed"),
        (gen([5], 4, sampling_seed=1e30), "sampling_seed"),
        (gen([5], 4, n=10**30), "sampling_params.n"),
        (gen([5], 4, n=10**6), "at most"),
        (gen([5], 4, top_k=2**64), "top_k"),
        (dict(gen([5], 4), top_logprobs_num=10**20, return_logprob=True), "top_logprobs_num"),
    ]
    for body, msg in cases:
        status, out = call(server, "/generate", body)
        assert status == 400 and msg in out["error"]["message"], (body, out)
    for deep in (
        b"[" * 100_000 + b"]" * 100_000,
        b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ):
        status, out = call(server, "/generate", data=deep)
        assert status == 400 and "nested too deeply" in out["error"]["message"], out
    status, out = call(
        server,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 10**30,
            "backend": "gloo",
        },
    )
    assert status == 400 and "world_size" in out["error"]["message"], out
    status, out = call(server, "/generate", gen([5, 6], 3, sampling_seed=2**63 - 1))
    assert status == 200 and len(out["output_ids"]) == 3


def test_huge_numbers_and_bodies_are_4xx_naming_the_field(server):
    """Integers that overflow a float (10**400) in float fields and token ids, and a body
    beyond the size limit: 4xx naming the field, never 500."""
    for body, msg in [
        (gen([5], 4, temperature=10**400), "temperature"),
        (gen([5], 4, top_p=-(10**400)), "top_p"),
        (gen([5], 4, repetition_penalty=10**400), "repetition_penalty"),
        (gen([5], 4, logit_bias={"5": 10**400}), "logit_bias"),
        (gen([10**400], 4), "input_ids"),
    ]:
        status, out = call(server, "/generate", body)
        assert status == 400 and msg in out["error"]["message"], (msg, status, out)
    status, _ = call(server, "/generate", data=b'{"text": "' + b"a" * (65 << 20) + b'"}')
    assert status == 413
    status, out = call(server, "/generate", gen([5, 6], 3))
    assert status == 200 and len(out["output_ids"]) == 3


# ------------------------------------------------------------------ item 10: disconnects


def _raw_generate(server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection((server.host, server.port), timeout=30)
    s.sendall(
        b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def test_client_that_disconnects_frees_its_slot(server):
    """Eight clients start long generations and hang up once all eight are running: the
    requests leave the batch (num_running drops to 0) and the tokens generated for them stay
    far below 8 x LONG, i.e. they did not run to their length."""
    n = 8
    poll(lambda: info(server)["num_running"] == 0, "idle server")
    start = info(server)["tokens_generated"]
    socks = [_raw_generate(server, gen([3, 4, 5], LONG, temperature=1.0)) for _ in range(n)]
    try:
        poll(lambda: info(server)["num_running"] == n, f"{n} requests running")
    finally:
        for s in socks:
            s.close()
    end = poll(
        lambda: (lambda i: i if i["num_running"] == 0 and i["num_waiting"] == 0 else None)(
            info(server)
        ),
        "slots freed",
        timeout=300,
    )
    generated = end["tokens_generated"] - start
    assert generated < n * LONG // 2, f"{generated} tokens generated for disconnected clients"
    status, out = call(server, "/generate", gen([5, 6], 4))
    assert status == 200 and len(out["output_ids"]) == 4


# ------------------------------------------------------------------ item 12: slow clients


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except socket.timeout:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_slow_header_and_body_connections_are_closed(server):
    """20 sockets that send part of a request header and then nothing are closed by the server
    (--idle-timeout) while normal requests keep succeeding; a request whose body stops
    arriving is answered 408 and closed."""
    slow = []
    for _ in range(20):
        s = socket.create_connection((server.host, server.port), timeout=30)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        s.settimeout(0.2)
        slow.append(s)
    body_slow = socket.create_connection((server.host, server.port), timeout=30)
    body_slow.sendall(
        b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {API_KEY}\r\n".encode()
        + b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"in'
    )
    try:
        status, out = call(server, "/generate", gen([5, 6], 3))
        assert status == 200 and len(out["output_ids"]) == 3
        open_ = set(range(len(slow)))

        def all_closed():
            for i in list(open_):
                if _closed_by_peer(slow[i]):
                    open_.discard(i)
            return not open_

        poll(all_closed, "slow-header sockets closed by the server", timeout=60)
        answer = b""
        body_slow.settimeout(60)
        while True:
            chunk = body_slow.recv(4096)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"--idle-timeout" in answer
        status, out = call(server, "/generate", gen([5, 6], 3))
        assert status == 200 and len(out["output_ids"]) == 3
    finally:
        for s in slow + [body_slow]:
            s.close()


# ------------------------------------------------------------------ item 11: pending joins


def test_pending_group_join_blocks_nothing_and_sigterm_exits(model):
    """Joins towards a closed port are pending (bounded timeout): pause, continue, a disk
    weight load and generation answer; using or re-joining a joining group is 409; an
    unbounded timeout_s is 400; SIGTERM stops the server without waiting for the joins."""
    srv = LocalServerProcess(str(model), api_key=API_KEY).wait_ready(120)
    closed_port = free_port()
    pending = ThreadPoolExecutor(4)
    try:
        join = {
            "master_address": "127.0.0.1",
            "master_port": closed_port,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
            "timeout_s": 600,
        }
        status, out = call(
            srv, "/init_weights_update_group", dict(join, group_name="huge", timeout_s=1e12)
        )
        assert status == 400 and "timeout_s" in out["error"]["message"], out
        names = [f"g{i}" for i in range(4)]
        # these requests stay open until the server goes away
        joins = [
            pending.submit(
                call, srv, "/init_weights_update_group", dict(join, group_name=name), None, 900
            )
            for name in names
        ]
        poll(lambda: sorted(info(srv).get("joining_groups", [])) == names, "joins pending")
        status, out = call(
            srv,
            "/update_weights_from_distributed",
            {"names": [], "dtypes": [], "shapes": [], "group_name": "g0"},
        )
        assert status == 409 and "still joining" in out["error"]["message"], out
        status, out = call(srv, "/init_weights_update_group", dict(join, group_name="g1"))
        assert status == 409, out
        status, out = call(srv, "/destroy_weights_update_group", {"group_name": "g2"})
        assert status == 409, out
        assert call(srv, "/pause_generation", {})[0] == 200
        assert call(srv, "/continue_generation", {})[0] == 200
        status, out = call(
            srv, "/update_weights_from_disk", {"model_path": str(model), "weight_version": "7"}
        )
        assert status == 200 and out["weight_version"] == "7", out
        status, out = call(srv, "/generate", gen([5, 6], 3))
        assert status == 200 and out["meta_info"]["weight_version"] == "7"
        srv.proc.terminate()
        try:
            rc = srv.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"SIGTERM did not stop the server while joins were pending (rc={rc})"
        for f in joins:  # each pending join was answered, not dropped
            status, out = f.result(timeout=60)
            assert status == 503 and "shutting down" in out["error"]["message"], out
    finally:
        srv.stop()
        pending.shutdown(wait=False, cancel_futures=True)


def test_a_socket_flood_under_a_low_fd_limit_leaves_the_server_serving(model):
    """1,100 idle or half-sent sockets against a server whose file descriptor limit is 256:
    it keeps accepting (idle connections closed for newcomers, no traceback per socket),
    a generation is served, SIGTERM still stops it cleanly."""
    port = free_port()
    boot = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, "
        "resource.getrlimit(resource.RLIMIT_NOFILE)[1])); sys.argv = sys.argv[1:]; "
        "runpy.run_module('areal_mega.inference.server', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            boot,
            "server",
            "--model-path",
            str(model),
            "--port",
            str(port),
            "--idle-timeout",
            str(IDLE_S),
        ],
        env={**os.environ, "AREAL_ROLLOUT_API_KEY": API_KEY},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    srv = SimpleNamespace(addr=f"127.0.0.1:{port}", host="127.0.0.1", port=port)
    socks = []
    try:
        poll(lambda: _healthy(srv), "server up")
        for i in range(1100):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        t0 = time.monotonic()
        status, out = call(srv, "/generate", gen([5, 6], 3), timeout=30)
        served_s = time.monotonic() - t0
        assert status == 200 and len(out["output_ids"]) == 3
        print(f"\nserver (256 fds) under 1,100 sockets: generation served in {served_s:.2f} s")
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert err.count(b"Traceback") == 0 and len(err) < 20_000, err[-2000:]
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(srv) -> bool:
    try:
        return call(srv, "/health", timeout=5)[0] == 200
    except OSError:
        return False

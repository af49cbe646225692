"""The vLLM server's command line, environment and interpreter (areal_mega.backends.vllm.launch)
and the key check on every route (areal_mega.backends.vllm.auth).

The command line is checked against vLLM's own parser and app, run by the vLLM interpreter
(tests/helpers/vllm_probe_worker.py: parsed as the server parses it, the app built without an
engine)."""

import ast
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.backends.vllm import auth as vllm_auth
from areal_mega.backends.vllm.auth import BearerOnEveryRoute
from areal_mega.backends.vllm.launch import (
    PACKAGE_ROOT,
    SERVED_MODEL_NAME,
    SUPPORTED_VLLM_VERSIONS,
    VLLM_AUTH_MIDDLEWARE,
    VLLM_PYTHON_ENV,
    VLLM_WORKER_EXTENSION,
    build_vllm_command,
    check_vllm_python,
    resolve_vllm_python,
    vllm_env,
)
from areal_mega.config import ConfigError
from tests.helpers.vllm_env import vllm_python
from tests.helpers.workers import worker_cmd

ROOT = Path(__file__).resolve().parents[1]
KEY = "vllm-test-key-5d1c"


# ----------------------------------------------------------------------------- command line


def test_command_has_the_flags_we_rely_on():
    argv = build_vllm_command(
        "/v/bin/python", "/models/m", 8311, dtype="fp32", seed=4, max_model_len=512
    )
    assert argv == [
        "/v/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8311",
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--tensor-parallel-size",
        "1",
        "--dtype",
        "float32",
        "--seed",
        "4",
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        VLLM_WORKER_EXTENSION,
        "--middleware",
        VLLM_AUTH_MIDDLEWARE,
        "--enable-scale-out",
        "--enforce-eager",
        "--max-model-len",
        "512",
    ]


def test_command_options():
    argv = build_vllm_command(
        "py",
        "m",
        1,
        host="0.0.0.0",
        tp=4,
        pp=2,
        dtype="bf16",
        enforce_eager=False,
        served_model_name="x",
        gpu_memory_utilization=0.7,
        extra=["--max-num-seqs", 8],
    )
    joined = " ".join(argv)
    assert "--tensor-parallel-size 4 --pipeline-parallel-size 2 --dtype bfloat16" in joined
    assert "--host 0.0.0.0" in joined and "--served-model-name x" in joined
    assert "--enforce-eager" not in argv and "--seed" not in argv  # vLLM's defaults
    assert "--max-model-len" not in argv  # 0: the model's
    assert argv[-4:] == ["--gpu-memory-utilization", "0.7", "--max-num-seqs", "8"]
    assert "--pipeline-parallel-size" not in build_vllm_command("py", "m", 1, pp=1)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(dtype="fp8"), "dtype='fp8'"),
        (dict(tp=0), "tp=0"),
        (dict(pp=0), "pp=0"),
        (dict(max_model_len=-1), "max_model_len=-1"),
        (dict(port=0), "port=0"),
        (dict(port=70000), "port=70000"),
        (dict(gpu_memory_utilization=0.0), "(0, 1]"),
        (dict(gpu_memory_utilization=1.2), "(0, 1]"),
        (dict(extra=["--api-key", "k"]), "--api-key"),
        (dict(extra=["--api-key=k"]), "--api-key"),
    ],
)
def test_command_refuses(kw, words):
    args = {"port": 1, **kw}
    port = args.pop("port")
    with pytest.raises(ValueError) as e:
        build_vllm_command("py", "m", port, **args)
    assert words in str(e.value)


# ----------------------------------------------------------------------------- environment


def test_env_cpu_with_key():
    env = vllm_env(KEY, "cpu", 2.0, "/repo", environ={"PYTHONPATH": "/a:/repo::/b"})
    assert env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_API_KEY": KEY,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "PYTHONPATH": os.pathsep.join(["/repo", "/a", "/b"]),
    }


def test_env_gpu_without_key():
    env = vllm_env(None, "cuda", 0.5, environ={})
    assert "VLLM_API_KEY" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env  # GPU: no CPU KV
    assert env["PYTHONPATH"] == str(PACKAGE_ROOT) and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert (PACKAGE_ROOT / "areal_mega" / "backends" / "vllm" / "auth.py").is_file()
    assert vllm_env("", "cpu", 1, environ={}).get("VLLM_API_KEY") is None
    for bad in (0.5, 1.5, 0):
        with pytest.raises(ValueError, match="whole number of GiB"):
            vllm_env(None, "cpu", bad, environ={})


def test_resolve_python_precedence(tmp_path, monkeypatch):
    default = str(PACKAGE_ROOT / ".venv-vllm" / "bin" / "python")
    assert resolve_vllm_python("", environ={}) == default
    assert resolve_vllm_python("", environ={VLLM_PYTHON_ENV: "/e/python"}) == "/e/python"
    assert resolve_vllm_python("/c/python", environ={VLLM_PYTHON_ENV: "/e/python"}) == "/c/python"
    monkeypatch.chdir(tmp_path)
    assert resolve_vllm_python("v/bin/python", environ={}) == str(tmp_path / "v/bin/python")
    link = tmp_path / "python"
    link.symlink_to(sys.executable)  # a venv's python is a symlink: kept
    assert resolve_vllm_python(str(link), environ={}) == str(link)


# ----------------------------------------------------------------------------- interpreter


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_check_python_missing_or_not_runnable(tmp_path):
    for path, words in (
        (tmp_path / "nope" / "python", "does not exist"),
        (tmp_path, "is not an executable file"),
    ):
        with pytest.raises(ConfigError) as e:
            check_vllm_python(str(path))
        msg = str(e.value)
        assert msg.startswith(f"rollout.vllm.python: {str(path)!r} {words}")
        assert "make vllm-env" in msg and "0.32.x" in msg
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    with pytest.raises(ConfigError, match="is not an executable file"):
        check_vllm_python(str(plain))


def test_check_python_without_vllm():
    """The trainer's own Python has no vLLM: what it printed is in the message."""
    with pytest.raises(ConfigError) as e:
        check_vllm_python(sys.executable)
    msg = str(e.value)
    assert f"rollout.vllm.python: {sys.executable!r} cannot import vllm or our extension" in msg
    assert "(exit 1)" in msg
    assert "No module named 'vllm'" in msg and "make vllm-env" in msg


def test_check_python_odd_interpreters(tmp_path):
    with pytest.raises(
        ConfigError, match=r"cannot import vllm or our extension .*\(exit 3\):\nbroken"
    ):
        check_vllm_python(_script(tmp_path / "p1", "echo broken >&2; exit 3"))
    with pytest.raises(ConfigError, match=r"has vLLM \(no version printed\)"):
        check_vllm_python(_script(tmp_path / "p2", "exit 0"))
    with pytest.raises(ConfigError, match="did not finish in 0.5 s"):
        check_vllm_python(_script(tmp_path / "p3", "exec sleep 30"), timeout_s=0.5)


def test_check_python_real_vllm():
    python = vllm_python()
    version = check_vllm_python(python)
    assert version.startswith(SUPPORTED_VLLM_VERSIONS)
    with pytest.raises(ConfigError) as e:
        check_vllm_python(python, supported=("0.31.",))
    assert f"has vLLM {version}; this code supports 0.31.x" in str(e.value)


# ----------------------------------------------------------------------------- against vLLM

# (method, path, key) of each probe request; the app has no engine, so a request that gets
# through the middleware ends in 500 (no engine client), one that does not in 401
REQUESTS = [
    ("GET", "/health", None),
    ("POST", "/collective_rpc", None),
    ("POST", "/collective_rpc", "wrong"),
    ("POST", "/collective_rpc", KEY),
    ("POST", "/pause", None),
    ("GET", "/is_paused", None),
    ("GET", "/v1/models", None),
    ("POST", "/inference/v1/generate", None),
]


def _probe(python, argv, env) -> dict:
    r = subprocess.run(
        worker_cmd("vllm_probe_worker", json.dumps(argv[3:]), json.dumps(REQUESTS), python=python),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllm_parses_our_command_and_guards_every_route():
    python = vllm_python()
    argv = build_vllm_command(
        python,
        "/models/tiny",
        8311,
        tp=1,
        dtype="fp32",
        seed=7,
        max_model_len=256,
        gpu_memory_utilization=0.5,
        extra=["--max-num-seqs", "4"],
    )
    env = vllm_env(KEY, "cpu", 1)
    got = _probe(python, argv, env)
    assert {
        k: got[k]
        for k in (
            "model",
            "served_model_name",
            "tensor_parallel_size",
            "dtype",
            "seed",
            "logprobs_mode",
            "worker_extension_cls",
            "enforce_eager",
            "max_model_len",
            "gpu_memory_utilization",
            "host",
            "port",
            "middleware",
            "api_key",
            "enable_scale_out",
        )
    } == {
        "model": "/models/tiny",
        "served_model_name": [SERVED_MODEL_NAME],
        "tensor_parallel_size": 1,
        "dtype": "float32",
        "seed": 7,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": VLLM_WORKER_EXTENSION,
        "enforce_eager": True,
        "max_model_len": 256,
        "gpu_memory_utilization": 0.5,
        "host": "127.0.0.1",
        "port": 8311,
        "middleware": [VLLM_AUTH_MIDDLEWARE],
        "api_key": None,  # the key came from the environment
        "enable_scale_out": True,
    }
    # /health open; the development routes and /v1 need the key; with it, through
    assert got["status"] == [500, 401, 401, 500, 401, 401, 401, 401]
    # without our middleware vLLM's own check leaves the development routes open: why it exists
    assert got["status_bare"] == [500, 500, 500, 500, 500, 500, 401, 401]


# ----------------------------------------------------------------------------- middleware


async def _app(scope, receive, send):
    """The wrapped app: answers 200."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(mw, method="POST", path="/collective_rpc", auth=None, kind="http", root=""):
    """One request through the middleware ``mw``: the status it got (200: reached the app),
    or the close code of a refused WebSocket."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(msg):
        sent.append(msg)

    headers = [(b"host", b"x")] + ([(b"authorization", auth.encode())] if auth else [])
    asyncio.run(
        mw(
            {"type": kind, "method": method, "path": path, "root_path": root, "headers": headers},
            receive,
            send,
        )
    )
    return sent[0].get("status", sent[0].get("code"))


def test_middleware_rules():
    mw = BearerOnEveryRoute(_app, api_key=KEY)
    assert _call(mw, "GET", "/health") == 200  # the readiness probe
    assert _call(mw) == 401
    assert _call(mw, auth=f"Bearer {KEY}x") == 401
    assert _call(mw, auth=f"Basic {KEY}") == 401
    assert _call(mw, auth="Bearer") == 401
    assert _call(mw, auth=f"Bearer {KEY}") == 200
    assert _call(mw, auth=f"bearer {KEY}") == 200  # the scheme ignores case
    assert _call(mw, "GET", "/v1/models") == 401
    assert _call(mw, "GET", "/health/") == 401  # only the exact probe path
    assert _call(mw, "OPTIONS", "/collective_rpc") == 200  # CORS preflight
    assert _call(mw, "GET", "/api/health", root="/api") == 200
    assert _call(mw, kind="websocket", path="/v1/realtime") == 1008
    assert _call(BearerOnEveryRoute(_app, api_key="")) == 200  # no key: loopback only


def test_middleware_reads_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    mw = BearerOnEveryRoute(_app)
    assert _call(mw) == 401 and _call(mw, auth=f"Bearer {KEY}") == 200
    monkeypatch.delenv("VLLM_API_KEY")
    assert _call(BearerOnEveryRoute(_app)) == 200


def test_middleware_needs_only_the_standard_library():
    """vLLM's Python imports it from this checkout: nothing of ours, nothing installed."""
    tree = ast.parse(Path(vllm_auth.__file__).read_text())
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert imported <= set(sys.stdlib_module_names), imported


def test_the_pinned_vllm_is_a_supported_one():
    """requirements-vllm.txt (what `make vllm-env` installs) against SUPPORTED_VLLM_VERSIONS,
    and `make test` builds that environment first."""
    pins = [
        line.split("==", 1)[1].strip()
        for line in (ROOT / "requirements-vllm.txt").read_text().splitlines()
        if line.startswith("vllm-cpu==")
    ]
    assert len(pins) == 1 and pins[0].startswith(SUPPORTED_VLLM_VERSIONS), pins
    make = subprocess.run(
        ["make", "-n", "-p", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    test_rule = next(x for x in make.splitlines() if x.startswith("test:"))
    assert ".venv-vllm/.installed" in test_rule, test_rule

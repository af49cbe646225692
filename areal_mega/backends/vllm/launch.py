"""vLLM rollout servers as processes: the command line, the environment, the interpreter.

vLLM pins its own torch, so it lives in its own virtual environment (``make vllm-env`` builds
``<repository>/.venv-vllm``; ``rollout.vllm.python`` or ``$AREAL_VLLM_PYTHON`` name another)
and the launcher starts ``<that python> -m vllm.entrypoints.openai.api_server``. vLLM's own
processes import two modules of ours from this checkout (``PYTHONPATH``, :func:`vllm_env`):
the worker extension that receives weight updates (:data:`VLLM_WORKER_EXTENSION`) and the
middleware that asks for the API key on every route but ``/health``
(:data:`VLLM_AUTH_MIDDLEWARE`, :mod:`areal_mega.backends.vllm.auth`).

The API key never goes on the command line: vLLM reads it from ``VLLM_API_KEY``.
Pure functions but :func:`check_vllm_python`, which runs the interpreter once; no torch, no
vllm import here (the launcher's Python has neither necessarily).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping, Optional

from areal_mega.common.errors import ConfigError

__all__ = [
    "VLLM_WORKER_EXTENSION",
    "VLLM_AUTH_MIDDLEWARE",
    "SUPPORTED_VLLM_VERSIONS",
    "SERVED_MODEL_NAME",
    "VLLM_PYTHON_ENV",
    "PACKAGE_ROOT",
    "build_vllm_command",
    "vllm_env",
    "resolve_vllm_python",
    "check_vllm_python",
]

#: the class vLLM's workers mix in (``--worker-extension-cls``): weight updates from the trainer
VLLM_WORKER_EXTENSION = "areal_mega.backends.vllm.worker_extension.WeightSyncExtension"
#: ASGI middleware (``--middleware``): vLLM's own key check guards only /v1, /v2, /inference and
#: /cohere, not the development routes (/collective_rpc, /pause, ...) that weight syncs use
VLLM_AUTH_MIDDLEWARE = "areal_mega.backends.vllm.auth.BearerOnEveryRoute"
#: vLLM releases whose routes and worker API this code is written against (version prefixes)
SUPPORTED_VLLM_VERSIONS = ("0.32.",)
#: the model name the servers answer to (``--served-model-name``), whatever ``model.path`` is
SERVED_MODEL_NAME = "policy"
#: environment variable naming the vLLM interpreter when ``rollout.vllm.python`` is empty
VLLM_PYTHON_ENV = "AREAL_VLLM_PYTHON"
#: the directory that holds the ``areal_mega`` package (a checkout's root)
PACKAGE_ROOT = Path(__file__).resolve().parents[3]
#: our trainer's logprobs are after temperature (as SGLang's and our CPU server's); vLLM's
#: default (raw_logprobs) is before it
LOGPROBS_MODE = "processed_logprobs"
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
BUILD_HINT = (
    "build it with `make vllm-env` (a Python 3.11 venv at <repository>/.venv-vllm "
    "from requirements-vllm.txt), or point rollout.vllm.python (or $AREAL_VLLM_PYTHON) "
    "at a Python that has vLLM " + " / ".join(v + "x" for v in SUPPORTED_VLLM_VERSIONS)
)


def build_vllm_command(
    python: str,
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    tp: int = 1,
    pp: int = 1,
    dtype: str = "bf16",
    max_model_len: int = 0,
    seed: Optional[int] = None,
    enforce_eager: bool = True,
    served_model_name: str = SERVED_MODEL_NAME,
    gpu_memory_utilization: Optional[float] = None,
    extra: Optional[list] = None,
) -> list:
    """The argv of one vLLM OpenAI-compatible server (``tp·pp`` devices).

    Always: ``--logprobs-mode processed_logprobs`` (logprobs after temperature, the trainer's
    convention), ``--worker-extension-cls`` :data:`VLLM_WORKER_EXTENSION`, ``--middleware``
    :data:`VLLM_AUTH_MIDDLEWARE` and ``--enable-scale-out`` (the token-in/token-out routes
    ``/inference/v1/generate`` and ``/inference/v1/abort_requests``). ``--max-model-len``
    only when ``max_model_len > 0`` (else vLLM takes the model's context),
    ``--pipeline-parallel-size`` only when ``pp > 1``,
    ``--gpu-memory-utilization`` only when given. Never the API key (``VLLM_API_KEY``, see
    :func:`vllm_env`): an ``--api-key`` in ``extra`` raises ValueError, as do bad sizes."""
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(VLLM_DTYPES)}")
    if tp < 1 or pp < 1:
        raise ValueError(f"tp={tp}, pp={pp}: must be >= 1")
    if max_model_len < 0:
        raise ValueError(f"max_model_len={max_model_len}: must be >= 0 (0 = the model's)")
    if not 0 < int(port) < 65536:
        raise ValueError(f"port={port}: must be in 1..65535")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: must be in (0, 1]")
    extra = [str(a) for a in extra or ()]
    if any(a.split("=", 1)[0] in ("--api-key", "--api_key") for a in extra):
        raise ValueError(
            "--api-key in the extra flags: the key would show in ps; it goes to "
            "the server as VLLM_API_KEY (vllm_env)"
        )
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        "--tensor-parallel-size",
        str(tp),
    ]
    if pp > 1:
        cmd += ["--pipeline-parallel-size", str(pp)]
    cmd += ["--dtype", VLLM_DTYPES[dtype]]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    cmd += [
        "--logprobs-mode",
        LOGPROBS_MODE,
        "--worker-extension-cls",
        VLLM_WORKER_EXTENSION,
        "--middleware",
        VLLM_AUTH_MIDDLEWARE,
        "--enable-scale-out",
    ]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if max_model_len > 0:
        cmd += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return cmd + extra


def vllm_env(
    api_key: Optional[str],
    device: str,
    kv_cache_gib: float = 1.0,
    package_root: Path | str = PACKAGE_ROOT,
    environ: Optional[Mapping[str, str]] = None,
) -> dict:
    """Environment entries of one vLLM server (added to the launcher's environment).

    ``VLLM_SERVER_DEV_MODE=1`` (the routes weight syncs use: /pause, /collective_rpc, ...);
    ``VLLM_API_KEY`` with a key; ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) on ``device="cpu"``;
    usage statistics off (vLLM would report to its server); ``PYTHONPATH`` = ``package_root``
    before ``environ``'s own PYTHONPATH (default ``os.environ``), so that vLLM's processes import
    our worker extension and middleware. Raises ValueError for a fractional KV cache on CPU."""
    environ = os.environ if environ is None else environ
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if device == "cpu":
        if not float(kv_cache_gib).is_integer() or kv_cache_gib < 1:
            raise ValueError(
                f"kv_cache_gib={kv_cache_gib}: vLLM's CPU KV cache "
                "(VLLM_CPU_KVCACHE_SPACE) is a whole number of GiB >= 1"
            )
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    root = str(package_root)
    rest = [p for p in (environ.get("PYTHONPATH") or "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def resolve_vllm_python(configured: str = "", environ: Optional[Mapping[str, str]] = None) -> str:
    """The vLLM interpreter: ``configured`` (``rollout.vllm.python``) when set, else
    ``$AREAL_VLLM_PYTHON``, else ``<repository>/.venv-vllm/bin/python``. A relative path is made
    absolute against the working directory; symlinks are kept (a venv's python is one, and
    resolving it would leave the venv)."""
    environ = os.environ if environ is None else environ
    path = (
        configured
        or environ.get(VLLM_PYTHON_ENV)
        or str(PACKAGE_ROOT / ".venv-vllm" / "bin" / "python")
    )
    return os.path.abspath(os.path.expanduser(path))


def check_vllm_python(
    python: str, supported: tuple = SUPPORTED_VLLM_VERSIONS, timeout_s: float = 300.0
) -> str:
    """Run ``python -c "import vllm; print(vllm.__version__)"`` and return the version; raise
    :class:`ConfigError` naming ``rollout.vllm.python``, the path, what it printed and how to
    build the environment when the interpreter is missing, cannot import vllm, or has a
    version outside ``supported`` (prefixes). The same run imports our worker extension and
    middleware with the servers' ``PYTHONPATH``: a broken one fails here, not ~40 s later in
    vLLM's engine."""
    where = f"rollout.vllm.python: {python!r}"
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        what = "is not an executable file" if os.path.exists(python) else "does not exist"
        raise ConfigError(f"{where} {what}; {BUILD_HINT}")
    try:
        proc = subprocess.run(
            [
                python,
                "-c",
                "import vllm; import areal_mega.backends.vllm.worker_extension, "
                "areal_mega.backends.vllm.auth; print(vllm.__version__)",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=vllm_env(None, "gpu")["PYTHONPATH"]),
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{where}: `import vllm` did not finish in {timeout_s:g} s; {BUILD_HINT}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{where} cannot run ({e}); {BUILD_HINT}") from None
    if proc.returncode != 0:
        said = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:]) or "(nothing)"
        raise ConfigError(
            f"{where} cannot import vllm or our extension (areal_mega."
            f"backends.vllm.worker_extension) (exit {proc.returncode}):\n{said}\n"
            f"{BUILD_HINT}"
        )
    lines = proc.stdout.strip().splitlines()
    version = lines[-1].strip() if lines else ""
    if not version.startswith(tuple(supported)):
        raise ConfigError(
            f"{where} has vLLM {version or '(no version printed)'}; this code "
            f"supports {', '.join(v + 'x' for v in supported)}; {BUILD_HINT}"
        )
    return version

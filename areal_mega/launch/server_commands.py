"""Each rollout backend's server process: command line, environment, secret, interpreter check.

- ``local``: our CPU server (:data:`ROLLOUT_SERVER_MODULE`), the API key in
  :data:`~areal_mega.security.API_KEY_ENV`;
- ``sglang``: :func:`~areal_mega.backends.sglang.build_sglang_command`, the key in a 0600 YAML
  file passed as ``--config`` (SGLang reads it only as a flag);
- ``vllm``: :func:`~areal_mega.backends.vllm.launch.build_vllm_command` run by the vLLM
  interpreter (``rollout.vllm.python``), the key in ``VLLM_API_KEY``; the interpreter is
  checked once before any process starts (:func:`check_server_runtime`).

No command line holds the API key (``ps`` shows argv to every user). Used by
:mod:`areal_mega.launch.local` (one machine, ``--serve-node``, elastic servers).
"""

from __future__ import annotations

import shlex
import sys
from typing import Optional

from areal_mega.backends.sglang import build_sglang_command
from areal_mega.backends.vllm.launch import (
    SERVED_MODEL_NAME,
    build_vllm_command,
    check_vllm_python,
    resolve_vllm_python,
    vllm_env,
)
from areal_mega.data.images import DEFAULT_MAX_IMAGES
from areal_mega.lora.targets import lora_server_flags
from areal_mega.parallel.allocation import parse_allocation
from areal_mega.rollout.routes import replay_server_flags
from areal_mega.run_dir import RunDir
from areal_mega.security import server_env, write_sglang_key_file

# The CPU rollout server (``--model-path DIR --port P``; the API key comes in the environment,
# see :func:`server_secrets`).
ROLLOUT_SERVER_MODULE = "areal_mega.inference.server"


def server_secrets(cfg) -> dict:
    """Hand ``rollout.api_key`` to the servers without putting it on a command line: the
    environment entry for our CPU server (:data:`~areal_mega.security.API_KEY_ENV`) and for
    vLLM (``VLLM_API_KEY``); for SGLang, which reads the key only as a flag, writes the 0600
    YAML file that :func:`server_command` passes as ``--config``. Empty without a key."""
    key = cfg.rollout.api_key
    if not key:
        return {}
    if cfg.rollout.backend == "local":
        return server_env(key)
    if cfg.rollout.backend == "vllm":
        return {"VLLM_API_KEY": key}
    write_sglang_key_file(RunDir.from_config(cfg).sglang_key_file, key)
    return {}


def backend_env(cfg, device: str) -> dict:
    """Environment entries a server of ``cfg.rollout.backend`` needs besides its GPUs and its
    key: for vLLM the development routes, the CPU KV cache, ``PYTHONPATH`` to this checkout
    (:func:`~areal_mega.backends.vllm.launch.vllm_env`); nothing for the others."""
    if cfg.rollout.backend != "vllm":
        return {}
    return vllm_env(None, device, cfg.rollout.vllm.kv_cache_gib)


def memory_fraction(cfg) -> float:
    """The share of a GPU a rollout server takes: ``rollout.vllm.gpu_memory_utilization``
    for vLLM when set, else ``rollout.mem_fraction_static`` (SGLang's flag of that name)."""
    v = cfg.rollout.vllm.gpu_memory_utilization
    return v if cfg.rollout.backend == "vllm" and v is not None else cfg.rollout.mem_fraction_static


def server_command(cfg, slot, host: str = "127.0.0.1") -> list:
    """The argv of one rollout server; never holds the API key (see :func:`server_secrets`)."""
    backend = cfg.rollout.backend
    if backend == "local":
        return (
            [
                sys.executable,
                "-m",
                ROLLOUT_SERVER_MODULE,
                "--model-path",
                cfg.model.path,
                "--host",
                host,
                "--port",
                str(slot.port),
                "--num-threads",
                str(cfg.cluster.cpu_threads_per_server),
            ]
            # the server loads and generates in the trainer's dtype (fp32 is its default)
            + ([] if cfg.model.dtype == "fp32" else ["--dtype", cfg.model.dtype])
            + replay_server_flags(cfg)
            + lora_server_flags(cfg)
            + (
                ["--lora-allowed-dirs", str(RunDir.from_config(cfg).root)]  # published adapters
                if lora_server_flags(cfg)
                else []
            )
            + (["--allow-unauthenticated"] if cfg.rollout.allow_unauthenticated else [])
            # a vision-language prompt's images: the dataset's limit is the server's
            + (
                ["--max-images", str(cfg.data.images.max_images)]
                if cfg.data.images.max_images != DEFAULT_MAX_IMAGES
                else []
            )
        )
    # each server sees only its own GPUs (CUDA_VISIBLE_DEVICES), so base_gpu_id is 0
    rollout = parse_allocation(cfg.allocation).rollout
    tp, pp = (rollout.tp, rollout.pp) if rollout else (1, 1)
    if backend == "vllm":
        v = cfg.rollout.vllm
        return build_vllm_command(
            resolve_vllm_python(v.python),
            cfg.model.path,
            slot.port,
            host=host,
            tp=tp,
            pp=pp,
            dtype=cfg.model.dtype,
            max_model_len=v.max_model_len,
            seed=cfg.seed + slot.index,
            enforce_eager=v.enforce_eager,
            served_model_name=SERVED_MODEL_NAME,
            gpu_memory_utilization=memory_fraction(cfg),
            extra=v.extra_args,
        )
    extra = ["--pp-size", str(pp)] if pp > 1 else []
    extra += replay_server_flags(cfg) + lora_server_flags(cfg)  # routing replay, LoRA
    return list(
        build_sglang_command(
            cfg.model.path,
            slot.port,
            host=host,
            tp=tp,
            mem_fraction_static=cfg.rollout.mem_fraction_static,
            dtype=cfg.model.dtype,
            base_gpu_id=0,
            api_key_file=RunDir.from_config(cfg).sglang_key_file if cfg.rollout.api_key else None,
            random_seed=cfg.seed + slot.index,
            extra=extra,
            allow_unauthenticated=cfg.rollout.allow_unauthenticated,
        )
    )


def check_server_runtime(cfg) -> Optional[str]:
    """Before any rollout server starts: for vLLM, that ``rollout.vllm.python`` imports a
    supported vLLM (ConfigError naming the key, the path and ``make vllm-env`` otherwise);
    returns a line for the log, or None for the other backends (they run in this Python or
    fail on their own first line)."""
    if cfg.rollout.backend != "vllm":
        return None
    python = resolve_vllm_python(cfg.rollout.vllm.python)
    return f"rollout servers: vLLM {check_vllm_python(python)} at {python}"


def describe_servers(cfg, slot, device: str) -> list:
    """Dry-run lines: the rollout backend and what server ``slot`` would run (its environment
    entries other than the GPUs; the key by name only)."""
    out = [
        f"rollout backend: {cfg.rollout.backend}; server {slot.index} runs: "
        f"{shlex.join(str(a) for a in server_command(cfg, slot))}"
    ]
    env = backend_env(cfg, device)
    if cfg.rollout.api_key and cfg.rollout.backend != "sglang":
        env.update({k: "<rollout.api_key>" for k in server_secrets(cfg)})
    if env:
        out.append("  with " + " ".join(f"{k}={v}" for k, v in env.items()))
    if cfg.rollout.backend == "vllm":
        out.append(
            "  (vLLM's interpreter is checked when the run starts: "
            "rollout.vllm.python, make vllm-env)"
        )
    return out

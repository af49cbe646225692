"""launch.local with ``rollout.backend: vllm``: the server processes it would start (argv, env,
readiness, logs), the interpreter check before anything starts, the dry run and the Slurm
layout variables. No vLLM server is started here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.backends.vllm.launch import (
    PACKAGE_ROOT,
    SERVED_MODEL_NAME,
    VLLM_AUTH_MIDDLEWARE,
    VLLM_PYTHON_ENV,
    VLLM_WORKER_EXTENSION,
)
from areal_mega.config import ConfigError, load_config
from areal_mega.launch import local
from areal_mega.launch.server_commands import check_server_runtime, memory_fraction
from areal_mega.run_dir import RunDir
from tests.helpers.vllm_env import vllm_python

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-cpu.yaml"
KEY = "launch-vllm-key-91af"
MISSING = "/nonexistent/vllm/bin/python"


def _cpu(tmp_path, *extra):
    return load_config(
        TINY,
        [
            "rollout.backend=vllm",
            "allocation=vllm:d2+megatron:d1",
            f"logging.run_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def _gpu(tmp_path, *extra):
    return load_config(
        ROOT / "recipes" / "qwen2.5-7b-math.yaml",
        [
            "rollout.backend=vllm",
            "allocation=vllm:d2t4+megatron:d4t2",
            f"logging.run_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_gpu_server_command_from_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    cfg = _gpu(
        tmp_path,
        f"rollout.api_key={KEY}",
        "seed=5",
        "rollout.vllm.max_model_len=4096",
        "rollout.vllm.extra_args=[--max-num-seqs, 32]",
    )
    lay = local.planned_layout(cfg)
    argv = local.server_command(cfg, lay.servers[1], "127.0.0.1")
    assert argv[:3] == [
        str(PACKAGE_ROOT / ".venv-vllm" / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    assert _flag(argv, "--model") == cfg.model.path and _flag(argv, "--port") == "30001"
    assert _flag(argv, "--tensor-parallel-size") == "4"  # the allocation's t
    assert _flag(argv, "--dtype") == "bfloat16"  # model.dtype bf16
    assert _flag(argv, "--seed") == "6"  # seed + server index
    assert _flag(argv, "--max-model-len") == "4096" and "--enforce-eager" in argv
    assert _flag(argv, "--gpu-memory-utilization") == str(cfg.rollout.mem_fraction_static)
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--worker-extension-cls") == VLLM_WORKER_EXTENSION
    assert _flag(argv, "--middleware") == VLLM_AUTH_MIDDLEWARE
    assert _flag(argv, "--served-model-name") == SERVED_MODEL_NAME
    assert argv[-2:] == ["--max-num-seqs", "32"]
    assert KEY not in " ".join(argv) and "--api-key" not in argv
    assert local.server_secrets(cfg) == {"VLLM_API_KEY": KEY}
    assert not RunDir.from_config(cfg).sglang_key_file.exists()  # no SGLang key file
    # the configured interpreter and GPU share win; the env var is the next choice
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/env/python")
    assert local.server_command(cfg, lay.servers[0])[0] == "/env/python"
    cfg2 = _gpu(
        tmp_path, "rollout.vllm.python=/cfg/python", "rollout.vllm.gpu_memory_utilization=0.55"
    )
    argv = local.server_command(cfg2, lay.servers[0])
    assert argv[0] == "/cfg/python" and _flag(argv, "--gpu-memory-utilization") == "0.55"
    assert memory_fraction(cfg2) == 0.55 and memory_fraction(cfg) == 0.8


def test_cpu_server_spec_env_and_readiness(tmp_path):
    cfg = _cpu(tmp_path, f"rollout.api_key={KEY}", "rollout.vllm.kv_cache_gib=2")
    slot = local.make_layout(cfg, "cpu", ports=[18001, 18002]).servers[1]
    spec = local.server_spec(cfg, slot, "127.0.0.1", True, local.server_secrets(cfg), "cpu")
    assert spec.name == "rollout1" and spec.restart and spec.kind == "service"
    env = spec.env
    assert env["VLLM_API_KEY"] == KEY and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "CUDA_VISIBLE_DEVICES" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(PACKAGE_ROOT)
    assert _flag(spec.argv, "--dtype") == "float32" and _flag(spec.argv, "--port") == "18002"
    assert _flag(spec.argv, "--seed") == str(cfg.seed + 1)
    assert spec.ready_timeout_s == cfg.cluster.server_ready_timeout_s
    assert spec.ready() is False  # GET /health on a port where nothing listens
    gpu = _gpu(tmp_path)
    slot = local.planned_layout(gpu).servers[1]
    env = local.server_spec(gpu, slot, "127.0.0.1", False, {}, "cuda").env
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert "VLLM_API_KEY" not in env


def test_build_specs_starts_vllm_servers(tmp_path):
    cfg = _cpu(tmp_path)
    specs, layout = local.build_specs(cfg, "cpu")
    names = [s.name for s in specs]
    assert names == ["rollout0", "rollout1", "rollout_worker", "trainer"]
    assert all(s.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] for s in specs[:2])
    resolved = load_config(tmp_path / "run" / "config.yaml")
    assert resolved.rollout.backend == "vllm"
    assert resolved.rollout.server_addrs == [f"127.0.0.1:{s.port}" for s in layout.servers]
    # a backend that disagrees with the allocation's rollout part is refused
    with pytest.raises(ConfigError, match="rollout.backend='vllm' but allocation=.*'local'"):
        local.make_layout(_cpu(tmp_path, "allocation=local:d1+megatron:d1"), "cpu")


def test_missing_interpreter_stops_the_launch_before_anything_starts(tmp_path, capsys):
    args = [
        "--config",
        str(TINY),
        "rollout.backend=vllm",
        "allocation=vllm:d1+megatron:d1",
        f"logging.run_dir={tmp_path / 'run'}",
        f"rollout.vllm.python={MISSING}",
    ]
    assert local.main(args) == 2
    err = capsys.readouterr().err
    assert f"config error: rollout.vllm.python: {MISSING!r} does not exist" in err
    assert "make vllm-env" in err
    assert not (tmp_path / "run" / "logs").exists()
    assert not (tmp_path / "run" / "config.yaml").exists()
    # the same check alone (run.sbatch calls it on the batch host)
    assert local.main(args + ["--check-rollout-env"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="rollout.vllm.python"):
        check_server_runtime(load_config(TINY, args[2:]))
    # external servers: nothing of ours starts, nothing to check
    assert local.main(args + ["rollout.server_addrs=127.0.0.1:9", "--dry-run"]) == 0
    assert (
        local.main(
            ["--config", str(TINY), "--check-rollout-env", f"logging.run_dir={tmp_path / 'run'}"]
        )
        == 0
    )
    assert "rollout.backend=local: nothing to check" in capsys.readouterr().out


def test_serve_node_checks_the_interpreter_first(tmp_path, capsys):
    args = [
        "--config",
        str(TINY),
        "--serve-node",
        "0",
        f"logging.run_dir={tmp_path / 'run'}",
        "cluster.device=cuda",
        "cluster.n_nodes=2",
        "cluster.n_gpus_per_node=1",
        "rollout.backend=vllm",
        "allocation=vllm:d1+megatron:d1",
        f"rollout.api_key={KEY}",
        f"rollout.vllm.python={MISSING}",
    ]
    assert local.main(args) == 2
    assert "rollout.vllm.python" in capsys.readouterr().err
    assert not (tmp_path / "run" / "logs").exists()


def test_dry_run_names_the_backend_and_needs_no_vllm(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), VLLM_PYTHON_ENV: MISSING}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.local",
            "--config",
            str(ROOT / "recipes" / "qwen2.5-7b-math.yaml"),
            "--dry-run",
            "rollout.backend=vllm",
            "allocation=vllm:d2t4+megatron:d4t2",
            f"rollout.api_key={KEY}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "rollout: 2 vllm server(s) x 4 GPU(s) (tp=4)" in out
    assert (
        f"rollout backend: vllm; server 0 runs: {MISSING} -m "
        "vllm.entrypoints.openai.api_server" in out
    )
    assert "--tensor-parallel-size 4" in out and "--port 30000" in out
    assert "VLLM_API_KEY=<rollout.api_key>" in out and KEY not in out
    assert "group world 9 = trainer rank 0 + 2 server(s) x 4 rank(s); rank offsets 1, 5" in out
    assert "at gpu_memory_utilization=0.8" in out


def test_layout_env_names_the_backend(tmp_path):
    env = local.layout_env(_gpu(tmp_path), ["10.0.0.1", "10.0.0.2"])
    assert env["ROLLOUT_BACKEND"] == "vllm" and env["WEIGHT_GROUP_WORLD_SIZE"] == 9
    assert env["SERVER_ADDRS"] == "10.0.0.1:30000,10.0.0.1:30001"
    assert local.layout_env(load_config(TINY))["ROLLOUT_BACKEND"] == "local"


def test_check_rollout_env_with_the_real_interpreter(tmp_path, capsys):
    python = vllm_python()
    assert (
        local.main(
            [
                "--config",
                str(TINY),
                "--check-rollout-env",
                "rollout.backend=vllm",
                "allocation=vllm:d1+megatron:d1",
                f"rollout.vllm.python={python}",
                f"logging.run_dir={tmp_path}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("rollout servers: vLLM 0.32.") and out.strip().endswith(python)

"""Packaging: setup.py's build-environment checks, the CUDA arch default, the TE pin, and the
runtime notice when the native kernels are missing."""

import importlib.metadata
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    """setup.py's functions, without running setuptools (it runs only as ``__main__``)."""
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")


def _run_setup_without_torch(tmp_path, **env):
    """Run ``setup.py --name`` where ``import torch`` / ``import numpy`` fail, like pip's
    isolated build environment."""
    block = tmp_path / "blocked"
    block.mkdir(exist_ok=True)
    for mod in ("torch", "numpy"):
        (block / f"{mod}.py").write_text(
            f"raise ImportError('{mod} is not installed in this build environment')\n"
        )
    full_env = {k: v for k, v in os.environ.items() if k != "AREAL_MEGA_SKIP_KERNELS"}
    full_env.update(env, PYTHONPATH=str(block))
    return subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_build_without_torch_stops_with_instructions(tmp_path):
    proc = _run_setup_without_torch(tmp_path)
    assert proc.returncode != 0
    err = proc.stderr
    assert "torch and numpy not importable" in err
    assert "pip install --no-build-isolation -e ." in err
    assert "AREAL_MEGA_SKIP_KERNELS=1" in err


def test_build_without_torch_can_skip_kernels_loudly(tmp_path):
    proc = _run_setup_without_torch(tmp_path, AREAL_MEGA_SKIP_KERNELS="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "areal-mega"
    assert "installing WITHOUT the csrc kernels" in proc.stderr


def test_check_build_deps(setup_py):
    check = setup_py["check_build_deps"]
    assert check(True, True, {}) is None
    with pytest.raises(SystemExit, match="numpy not importable"):
        check(True, False, {})
    assert "WITHOUT the csrc kernels" in check(False, True, {"AREAL_MEGA_SKIP_KERNELS": "1"})


def test_cuda_arch_list_default(setup_py):
    arch = setup_py["cuda_arch_list"]
    assert arch({}, []) == "8.0;9.0+PTX"  # build node: no GPU visible
    assert arch({"TORCH_CUDA_ARCH_LIST": " "}, []) == "8.0;9.0+PTX"
    assert arch({}, [(9, 0)]) is None  # torch builds for the GPU
    assert arch({"TORCH_CUDA_ARCH_LIST": "8.6"}, []) == "8.6"  # explicit choice wins
    assert arch({"TORCH_CUDA_ARCH_LIST": "8.6"}, [(9, 0)]) == "8.6"


def test_cuda_home_skips_a_wrapper_nvcc_outside_the_toolkit(setup_py):
    home = setup_py["cuda_home"]
    toolkits = {"/usr/local/cuda", "/opt/cuda-13.0"}
    has = toolkits.__contains__
    assert home({"CUDA_HOME": "/x"}, "/usr/local/bin/nvcc", has) == "/x"  # explicit wins
    assert home({"CUDA_PATH": "/y"}, None, has) == "/y"
    # /usr/local/bin/nvcc (a wrapper script): torch would guess /usr/local, which has no headers
    assert home({}, "/usr/local/bin/nvcc", has) == "/usr/local/cuda"
    assert home({}, "/opt/cuda-13.0/bin/nvcc", has) == "/opt/cuda-13.0"
    assert home({}, None, lambda root: False) is None


def test_gpu_extra_pins_transformer_engine_inside_megatron_core_range(setup_py):
    declared = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []]
    te = [r for r in declared if r.name == "transformer-engine"]
    assert te, "megatron-core no longer declares transformer-engine"
    for core in ("core_cu13", "core_cu12"):
        pin = Requirement(setup_py["TE_PIN"].format(core=core))
        (spec,) = list(pin.specifier)
        assert spec.operator == "=="
        assert all(r.specifier.contains(spec.version, prereleases=True) for r in te), (
            pin,
            [str(r) for r in te],
        )
        assert {"pytorch", core} <= pin.extras


def test_missing_native_kernels_announced_once(monkeypatch, capsys):
    from areal_mega.ops import KernelFallbackWarning, _backend, packed_gae

    monkeypatch.delenv("AREAL_MEGA_OPS_BACKEND", raising=False)
    monkeypatch.setitem(_backend._modules, "_ops_cpu", None)
    monkeypatch.setitem(_backend._errors, "_ops_cpu", ImportError("simulated"))
    monkeypatch.setattr(_backend, "_warned", set())
    r, v = torch.ones(4), torch.zeros(4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.warns(KernelFallbackWarning, match="setup.py build_ext --inplace"):
        adv, _ = packed_gae(r, v, cu, gamma=1.0, lam=1.0)
    assert adv.shape == (4,)
    err = capsys.readouterr().err
    assert "pure-torch fallback" in err and "setup.py build_ext --inplace" in err
    packed_gae(r, v, cu, gamma=1.0, lam=1.0)  # once per process
    assert "pure-torch fallback" not in capsys.readouterr().err


def test_explicit_torch_backend_is_silent(monkeypatch, capsys):
    from areal_mega.ops import _backend

    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "torch")
    monkeypatch.setitem(_backend._modules, "_ops_cpu", None)
    monkeypatch.setattr(_backend, "_warned", set())
    assert _backend.select(torch.device("cpu")) is None
    assert capsys.readouterr().err == ""


def test_gpu_check_without_cuda_exits_with_a_clear_message():
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 2
    assert "sees no CUDA device" in proc.stderr and "--dry-run" in proc.stderr


def test_gpu_check_dry_run_lists_every_step():
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    listed = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]
    assert listed == [
        "build",
        "doctor",
        "gpu-tests",
        "kernel-bench",
        "prepare",
        "train-bf16",
        "e2e-rl",
    ]


def test_gpu_check_table_and_step_failure():
    from tools import gpu_check

    def boom(step, work):
        raise gpu_check.StepFailed("exit 1: boom")

    def fine(step, work):
        step.figure = "3 passed"

    steps = [gpu_check.Step("a", "", fine), gpu_check.Step("b", "", boom)]
    for s in steps:
        s.execute(Path("."))
    assert [s.status for s in steps] == ["pass", "fail"]
    table = gpu_check.format_table(steps).splitlines()
    assert table[0].split()[:3] == ["step", "result", "seconds"]
    assert "PASS" in table[2] and "3 passed" in table[2]
    assert "FAIL" in table[3] and "boom" in table[3]

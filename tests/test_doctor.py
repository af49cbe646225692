"""``python -m areal_mega.doctor``: passes on this machine, and fails with the named row when
the kernel module is missing, when megatron-core's source no longer matches the CPU patches,
and when a rollout server computes logprobs other than the trainer's. Every failure is real:
a package copy without the compiled module, a megatron-core copy with an edited source file,
a real server started from a model config that differs from the trainer's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega import doctor
from areal_mega.doctor import tiny_run
from areal_mega.inference.process import LocalServerProcess

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(400)
CPU_ROWS = [
    "python",
    "packages",
    "kernels",
    "megatron-patches",
    "onednn",
    "logprob-kernel",
    "convert",
    "rollout-server",
    "rl-step",
    "weight-update",
]


def run_doctor(*args, cwd=ROOT, pythonpath=ROOT, timeout=300):
    """``python -m areal_mega.doctor --json ARGS``: (exit status, report, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [sys.executable, "-m", "areal_mega.doctor", "--json", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.stdout.strip(), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout), p.stderr


def rows_by_name(report):
    return {r["name"]: r for r in report["rows"]}


@pytest.fixture(scope="module")
def full_run():
    return run_doctor()


@pytest.mark.slow
def test_every_row_passes_on_this_machine(full_run):
    rc, report, err = full_run
    rows = rows_by_name(report)
    assert rc == 0 and report["ok"], json.dumps(report["rows"], indent=1)
    assert list(rows) == CPU_ROWS  # no CUDA here: the CUDA rows are not run
    assert all(r["status"] == "pass" for r in rows.values())
    assert "bit-exact" in rows["convert"]["detail"]
    assert "logprobs = trainer's" in rows["weight-update"]["detail"]
    # one progress line before and one after each row
    assert sum(ln.startswith("[doctor] ") for ln in err.splitlines()) == 2 * len(CPU_ROWS)
    print(f"\ndoctor wall time: {report['seconds']} s")


def test_missing_kernel_module_fails_the_kernel_rows(tmp_path):
    """A copy of the package without ``_ops_cpu*.so`` (as after an install that skipped the
    build): the kernels row fails and says how to build them; the kernel numbers are not
    compared."""
    shutil.copytree(
        ROOT / "areal_mega",
        tmp_path / "areal_mega",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    rc, report, _ = run_doctor(
        "--only", "kernels,logprob-kernel", cwd=tmp_path, pythonpath=tmp_path
    )
    rows = rows_by_name(report)
    assert rc == 1 and not report["ok"]
    assert rows["kernels"]["status"] == "fail"
    # not importable, or (an editable install of another checkout on sys.path) not this
    # package's own module: either way this checkout has no kernels
    assert (
        "_ops_cpu not importable" in rows["kernels"]["detail"]
        or "not from this package" in rows["kernels"]["detail"]
    )
    assert "build_ext --inplace" in rows["kernels"]["fix"]
    assert rows["logprob-kernel"]["status"] == "skip"
    assert rows["logprob-kernel"]["detail"] == "needs kernels to pass"


def test_changed_megatron_source_fails_the_patch_row(tmp_path):
    """megatron-core whose ``get_default_causal_mask`` was rewritten (as an upstream release
    might): the copy shadows the installed one and the patch row names the patch."""
    import importlib.util

    src = Path(importlib.util.find_spec("megatron.core").origin).parent  # not imported here
    dst = tmp_path / "megatron" / "core"
    shutil.copytree(src, dst)  # bytecode too (mtimes kept, still valid): no recompiling
    utils = dst / "transformer" / "utils.py"
    text = utils.read_text()
    old = 'torch.ones(sq, sq, device="cuda")'
    assert old in text
    utils.write_text(text.replace(old, 'torch.ones(sq, sq, device=torch.device("cuda"))'))
    rc, report, _ = run_doctor(
        "--only", "megatron-patches", pythonpath=f"{tmp_path}{os.pathsep}{ROOT}"
    )
    row = rows_by_name(report)["megatron-patches"]
    assert rc == 1 and row["status"] == "fail"
    assert "torch_view:utils" in row["detail"] and "no longer contains" in row["detail"]
    from areal_mega.compat.megatron_cpu import MEGATRON_CORE_VERSION

    assert f"megatron-core=={MEGATRON_CORE_VERSION}" in row["fix"]


@pytest.mark.slow
def test_server_with_wrong_logprobs_fails_the_weight_update_row(tmp_path):
    """A real CPU server started from the trainer's model directory with one config value
    changed (``rms_norm_eps``): the published weights reach it, but its logprobs are not the
    trainer's, and the weight-update row says so."""
    ctx = doctor.new_context(str(tmp_path / "work"))
    model = tiny_run.doctor_model(ctx)
    bad = tmp_path / "bad_model"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.1
    (bad / "config.json").write_text(json.dumps(cfg))
    srv = LocalServerProcess(str(bad), log_path=str(tmp_path / "bad_server.log"))
    try:
        srv.wait_ready(120)
        ctx.server_addr = srv.addr
        checks = [
            c for c in doctor.CHECKS if c.name in ("rollout-server", "rl-step", "weight-update")
        ]
        rows = {r.name: r for r in doctor.run_checks(checks, ctx)}
    finally:
        srv.stop()
    assert rows["rollout-server"].status == "pass" and "given" in rows["rollout-server"].detail
    assert rows["rl-step"].status == "pass", rows["rl-step"].detail
    wu = rows["weight-update"]
    assert wu.status == "fail", wu.detail
    assert "server logprobs differ from the trainer's" in wu.detail and srv.addr in wu.detail
    assert "config.json" in wu.fix


def test_select_checks_adds_what_a_check_needs():
    names = [c.name for c in doctor.select_checks(["weight-update"])]
    assert names == ["megatron-patches", "rollout-server", "rl-step", "weight-update"]
    with pytest.raises(ValueError, match="unknown check"):
        doctor.select_checks(["nope"])


def test_a_crashing_check_is_a_failed_row_and_the_others_still_run(tmp_path):
    def crash(ctx):
        raise OSError("disk on fire")

    checks = [
        doctor.Check("crash", "raises", "put the fire out", crash),
        doctor.Check("after", "needs crash", "", lambda ctx: "ran", needs=("crash",)),
        doctor.CHECKS[0],
    ]  # the python row
    rows = doctor.run_checks(checks, doctor.new_context(str(tmp_path)))
    assert [(r.name, r.status) for r in rows] == [
        ("crash", "fail"),
        ("after", "skip"),
        ("python", "pass"),
    ]
    assert rows[0].detail.startswith("OSError: disk on fire") and rows[0].fix == "put the fire out"
    table = doctor.format_table(rows)
    assert "to fix crash: put the fire out" in table and "FAIL" in table


def test_list_names_every_check():
    p = subprocess.run(
        [sys.executable, "-m", "areal_mega.doctor", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0
    assert [ln.split()[0] for ln in p.stdout.splitlines()] == [c.name for c in doctor.CHECKS]


def test_cuda_rows_skip_without_cuda(tmp_path, monkeypatch):
    """Asked for on a machine without CUDA, every CUDA row skips (saying so), none fails."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rows = doctor.run_checks(doctor.CUDA_CHECKS, doctor.new_context(str(tmp_path)), cuda=True)
    assert [r.name for r in rows] == ["cuda-kernels", "transformer-engine", "nccl", "sglang"]
    assert all(r.status == "skip" and r.detail == "no CUDA device" for r in rows), rows


def test_truncated_kernel_module_is_a_failed_row_not_a_crash(tmp_path):
    """A ``_ops_cpu*.so`` cut short (a failed copy, a full disk): loading it kills the process
    with SIGBUS (cut to its first 200 kB) or loads a module whose code is partly missing (cut in
    half); the doctor prints its table with the kernels row failed instead."""
    shutil.copytree(
        ROOT / "areal_mega", tmp_path / "areal_mega", ignore=shutil.ignore_patterns("__pycache__")
    )
    (so,) = (tmp_path / "areal_mega").glob("_ops_cpu*.so")
    whole = so.read_bytes()
    for size in (200_000, len(whole) // 2):
        so.write_bytes(whole[:size])
        rc, report, _ = run_doctor(
            "--only", "kernels,logprob-kernel", cwd=tmp_path, pythonpath=tmp_path
        )
        rows = rows_by_name(report)
        assert rc == 1 and not report["ok"]
        assert rows["kernels"]["status"] == "fail" and "truncated" in rows["kernels"]["detail"]
        assert "build_ext --inplace" in rows["kernels"]["fix"]
        assert rows["logprob-kernel"]["status"] == "skip"

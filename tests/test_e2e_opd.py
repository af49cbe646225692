"""On-policy distillation end to end on CPU (launch.local, tiny models): an in-trainer teacher
equal to the student gives ``opd/reverse_kl`` = 0 on step 1 and the run resumes with its
teacher; a different teacher (same tokenizer, other weights) gives a finite, nonzero signal
added to GRPO's advantages; a served teacher (a CPU server process) scores the same tokens
and its tokenizer is checked against the student's.

The runs join one CPU rollout server of this module (``rollout.server_addrs``: launch.local
starts none), brought back before each launch to what a server launch.local starts holds (the
student's weights at version 0, generating)."""

import json
import math
import socket
import subprocess
import time
from pathlib import Path

import pytest

from areal_mega.common.net import free_port
from areal_mega.config import ConfigError, load_config
from areal_mega.inference.process import launch_local_servers
from areal_mega.models.tiny import make_tiny_model
from areal_mega.train.teacher import build_teacher_scorer
from tests.helpers.local_runs import _finish, _launch, _metrics, check_preset_run, server_addrs_on
from tests.helpers.workers import worker_cmd, worker_env

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rollout_server(assets):
    """One CPU rollout server on the student for every launch of the module."""
    (srv,) = launch_local_servers(str(assets[0]), 1)
    try:
        yield srv
    finally:
        srv.stop()


def _check_rows(rows, steps):
    assert [r["step"] for r in rows] == steps
    for r in rows:
        assert math.isfinite(r["opd/reverse_kl"]) and math.isfinite(r["opd/abs_log_ratio"]), r
        assert r["opd/abs_log_ratio"] >= abs(r["opd/reverse_kl"]) - 1e-9
        assert r["time/teacher"] >= 0.0


def test_teacher_equal_to_student_has_zero_reverse_kl_and_resumes(assets, rollout_server, tmp_path):
    """Also the ``opd`` case of tests/test_e2e_presets.py: the preset's keys reach the trainer
    and every step's loss is finite."""
    model, data = assets
    run = tmp_path / "run"
    opd = (
        "algorithm.preset=opd",
        f"teacher.path={model}",
        "recover=auto",
        "rollout.max_head_offpolicyness=0",
        "checkpoint.save_every=1",
    )
    rc, out = _finish(
        _launch(run, model, data, "total_steps=3", *opd, server_addrs_on(rollout_server, model)),
        timeout=300,
    )
    assert rc == 0, out[-3000:]
    rows = _metrics(run)
    _check_rows(rows, [1, 2, 3])
    assert abs(rows[0]["opd/reverse_kl"]) <= 1e-6, rows[0]["opd/reverse_kl"]
    assert rows[0]["opd/abs_log_ratio"] <= 1e-6
    assert (run / "init_mcore_teacher").is_dir()
    check_preset_run(run, "opd", steps=3)
    # resumed: the teacher is loaded again (from its converted checkpoint), OPD goes on
    rc, out = _finish(
        _launch(run, model, data, "total_steps=4", *opd, server_addrs_on(rollout_server, model)),
        timeout=300,
    )
    assert rc == 0, out[-3000:]
    assert "resumed from" in (run / "logs" / "trainer.log").read_text()
    _check_rows(_metrics(run), [1, 2, 3, 4])


def test_other_teacher_added_to_grpo_advantages(assets, rollout_server, tmp_path):
    model, data = assets
    teacher = make_tiny_model(
        tmp_path / "teacher",
        arch="llama",
        charset="digits",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        seed=7,
    )
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run,
            model,
            data,
            "total_steps=2",
            "recover=off",
            "algorithm.opd=add",
            "algorithm.opd_coef=0.5",
            f"teacher.path={teacher}",
            "teacher.dtype=fp32",
            server_addrs_on(rollout_server, model),
        ),
        timeout=300,
    )
    assert rc == 0, out[-3000:]
    rows = _metrics(run)
    _check_rows(rows, [1, 2])
    assert rows[0]["opd/abs_log_ratio"] > 1e-3  # other weights: a real signal
    # the loss saw outcome + OPD term: nonzero even where GRPO's group advantage is 0
    assert rows[0]["advantage"] != 0.0 and math.isfinite(rows[0]["advantage"])


@pytest.fixture(scope="module")
def served_student(assets):
    """A CPU server process on the student model (API key ``teacher-key``): the served
    teacher of the tests below."""
    model, _ = assets
    (srv,) = launch_local_servers(str(model), 1, api_key="teacher-key")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def faulty_teacher(served_student, tmp_path):
    """tests/helpers/faulty_teacher_worker.py in front of the served student: its first scoring
    request is
    answered 503, its second carries a NaN and a +7 logprob, the rest pass unchanged.
    Yields (its address, its fault log)."""
    port, log = free_port(), tmp_path / "teacher_faults.jsonl"
    proc = subprocess.Popen(
        worker_cmd(
            "faulty_teacher_worker",
            "--upstream",
            f"http://{served_student.addr}",
            "--port",
            port,
            "--log",
            log,
        ),
        cwd=ROOT,
        env=worker_env(),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        yield f"127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_served_teacher_equal_to_student_has_zero_reverse_kl(
    assets, rollout_server, faulty_teacher, tmp_path
):
    """The teacher served by a CPU server process (SGLang's prompt-logprob request, scored
    from each sequence's first loss token): equal to the student, its scores land on the same
    tokens as the trainer's proximal logprobs, so step 1's reverse KL is ~0.

    It is reached through a faulty front (``faulty_teacher``): the first scoring request's 503
    (the only teacher server marked down) is retried after a probe, and the sequence whose
    logprobs hold a NaN and a +7 is refused and dropped from the loss; the run goes on, no
    optimizer step is skipped and no non-finite number reaches the metrics."""
    model, data = assets
    addr, fault_log = faulty_teacher
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run,
            model,
            data,
            "total_steps=2",
            "recover=off",
            "algorithm.preset=opd",
            f"teacher.server_addrs=[{addr}]",
            "teacher.api_key=teacher-key",
            "rollout.max_head_offpolicyness=0",
            server_addrs_on(rollout_server, model),
        ),
        timeout=300,
    )
    assert rc == 0, out[-3000:]
    faults = [json.loads(x)["fault"] for x in fault_log.read_text().splitlines()]
    assert faults[:3] == ["503", "nan", "none"], faults
    rows = _metrics(run)
    _check_rows(rows, [1, 2])
    assert abs(rows[0]["opd/reverse_kl"]) <= 1e-5, rows[0]["opd/reverse_kl"]
    assert rows[0]["opd/abs_log_ratio"] <= 1e-5
    assert sum(r.get("refused/teacher", 0.0) for r in rows) == 1.0, rows
    assert all(r["train/skipped"] == 0.0 and math.isfinite(r["loss"]) for r in rows), rows
    log = (run / "logs" / "trainer.log").read_text()
    assert "teacher-key" not in log
    assert "non-finite teacher logprobs (the teacher's answer)" in log


def test_served_teacher_with_another_tokenizer_is_refused(assets, served_student, tmp_path):
    model, _ = assets
    other = make_tiny_model(
        tmp_path / "ascii",
        arch="llama",
        charset="ascii",
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )
    cfg = load_config(
        ROOT / "recipes" / "tiny-cpu.yaml",
        [
            f"model.path={model}",
            "algorithm.preset=opd",
            "teacher.server_addrs=[x:1]",
            "teacher.api_key=teacher-key",
        ],
    )
    cfg.teacher.server_addrs = [served_student.addr]
    cfg.model.path = str(other)  # a student with another tokenizer: refused
    with pytest.raises(ConfigError, match=r"different tokenizers"):
        build_teacher_scorer(cfg)
    cfg.model.path = str(model)  # the same tokenizer: accepted
    scorer = build_teacher_scorer(cfg)
    try:
        (lp,) = scorer.score([[5, 6, 7, 8]], [1])
        assert lp.shape == (3,) and (lp < 0).all()
    finally:
        scorer.close()

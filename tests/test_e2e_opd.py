"""On-policy distillation end to end on CPU (launch.local, tiny models): an in-trainer teacher
equal to the student gives ``opd/reverse_kl`` = 0 on step 1 and the run resumes with its
teacher; a different teacher (same tokenizer, other weights) gives a finite, nonzero signal
added to GRPO's advantages."""
import math

import pytest

from areal_mega.models.tiny import make_tiny_model
from test_e2e_async_rl import _finish, _launch, _metrics, assets  # noqa: F401

pytestmark = pytest.mark.slow


def _check_rows(rows, steps):
    assert [r["step"] for r in rows] == steps
    for r in rows:
        assert math.isfinite(r["opd/reverse_kl"]) and math.isfinite(r["opd/abs_log_ratio"]), r
        assert r["opd/abs_log_ratio"] >= abs(r["opd/reverse_kl"]) - 1e-9
        assert r["time/teacher"] >= 0.0


def test_teacher_equal_to_student_has_zero_reverse_kl_and_resumes(assets, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    opd = ("algorithm.preset=opd", f"teacher.path={model}", "recover=auto",
           "rollout.max_head_offpolicyness=0", "checkpoint.save_every=1")
    rc, out = _finish(_launch(run, model, data, "total_steps=3", *opd), timeout=300)
    assert rc == 0, out[-3000:]
    rows = _metrics(run)
    _check_rows(rows, [1, 2, 3])
    assert abs(rows[0]["opd/reverse_kl"]) <= 1e-6, rows[0]["opd/reverse_kl"]
    assert rows[0]["opd/abs_log_ratio"] <= 1e-6
    assert (run / "init_mcore_teacher").is_dir()
    # resumed: the teacher is loaded again (from its converted checkpoint), OPD goes on
    rc, out = _finish(_launch(run, model, data, "total_steps=4", *opd), timeout=300)
    assert rc == 0, out[-3000:]
    assert "resumed from" in (run / "logs" / "trainer.log").read_text()
    _check_rows(_metrics(run), [1, 2, 3, 4])


def test_other_teacher_added_to_grpo_advantages(assets, tmp_path):
    model, data = assets
    teacher = make_tiny_model(tmp_path / "teacher", arch="llama", charset="digits",
                              hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=128, seed=7)
    run = tmp_path / "run"
    rc, out = _finish(_launch(run, model, data, "total_steps=2", "recover=off",
                              "algorithm.opd=add", "algorithm.opd_coef=0.5",
                              f"teacher.path={teacher}", "teacher.dtype=fp32"), timeout=300)
    assert rc == 0, out[-3000:]
    rows = _metrics(run)
    _check_rows(rows, [1, 2])
    assert rows[0]["opd/abs_log_ratio"] > 1e-3          # other weights: a real signal
    # the loss saw outcome + OPD term: nonzero even where GRPO's group advantage is 0
    assert rows[0]["advantage"] != 0.0 and math.isfinite(rows[0]["advantage"])

"""On-policy distillation: the OPD advantage (values, loss mask, pure / add / off) and the
reverse-KL sums behind ``opd/reverse_kl``."""

import pytest
import torch

from areal_mega.algo.distill import OPD_MODES, opd_advantages, reverse_kl_sums

ADV = torch.tensor([0.0, 0.5, 0.5, 0.5, 0.0, -1.0, -1.0])
STUDENT = torch.tensor([0.0, -1.0, -0.2, -3.0, 0.0, -0.5, -2.0])
TEACHER = torch.tensor([0.0, -0.5, -0.2, -1.0, 0.0, -1.5, -2.5])
MASK = torch.tensor([0, 1, 1, 1, 0, 1, 1])


def test_pure_replaces_the_outcome_advantage_with_minus_coef_times_the_log_ratio():
    out = opd_advantages(ADV, STUDENT, TEACHER, MASK, mode="pure", coef=2.0)
    want = torch.tensor([0.0, 1.0, 0.0, 4.0, 0.0, -2.0, -1.0])  # -2 * (s - t) on loss tokens
    assert torch.allclose(out, want)
    assert out.dtype == torch.float32


def test_add_adds_the_term_to_the_outcome_advantage():
    out = opd_advantages(ADV, STUDENT, TEACHER, MASK, mode="add", coef=1.0)
    want = torch.tensor([0.0, 1.0, 0.5, 2.5, 0.0, -2.0, -1.5])
    assert torch.allclose(out, want)


def test_tokens_outside_the_loss_mask_get_zero_even_with_nonzero_inputs():
    adv = torch.full((4,), 0.25)
    s, t = torch.tensor([-1.0, -2.0, -3.0, -4.0]), torch.tensor([-4.0, -3.0, -2.0, -1.0])
    mask = torch.tensor([1, 0, 0, 1])
    for mode in ("pure", "add"):
        out = opd_advantages(adv, s, t, mask, mode=mode)
        assert out[1] == 0 and out[2] == 0
        assert out[0] != 0 and out[3] != 0


def test_teacher_equal_to_student_gives_zero_in_pure_and_the_outcome_in_add():
    pure = opd_advantages(ADV, STUDENT, STUDENT.clone(), MASK, mode="pure", coef=5.0)
    assert torch.equal(pure, torch.zeros_like(ADV))
    add = opd_advantages(ADV, STUDENT, STUDENT.clone(), MASK, mode="add", coef=5.0)
    assert torch.allclose(add, ADV * MASK)


def test_off_returns_a_copy_of_the_advantages_and_inputs_are_not_modified():
    before = [x.clone() for x in (ADV, STUDENT, TEACHER, MASK)]
    out = opd_advantages(ADV, STUDENT, TEACHER, MASK, mode="off")
    assert torch.equal(out, ADV) and out.data_ptr() != ADV.data_ptr()
    opd_advantages(ADV, STUDENT, TEACHER, MASK, mode="add")
    for a, b in zip(before, (ADV, STUDENT, TEACHER, MASK)):
        assert torch.equal(a, b)


def test_fp64_inputs_stay_fp64():
    out = opd_advantages(ADV.double(), STUDENT.double(), TEACHER.double(), MASK, mode="add")
    assert out.dtype == torch.float64


def test_bad_mode_and_shapes_raise():
    assert OPD_MODES == ("off", "pure", "add")
    with pytest.raises(ValueError, match="opd mode"):
        opd_advantages(ADV, STUDENT, TEACHER, MASK, mode="forward_kl")
    with pytest.raises(ValueError, match="different shapes"):
        opd_advantages(ADV, STUDENT[:3], TEACHER, MASK, mode="pure")


def test_reverse_kl_sums_count_only_loss_tokens():
    sums = reverse_kl_sums(STUDENT, TEACHER, MASK)
    diffs = [-0.5, 0.0, -2.0, 1.0, 0.5]
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([sum(diffs), sum(abs(d) for d in diffs), 5.0])
    assert reverse_kl_sums(STUDENT, STUDENT, MASK).tolist()[:2] == [0.0, 0.0]

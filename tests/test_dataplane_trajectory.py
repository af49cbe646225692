"""Trajectory construction and validation: every rule names the bad field."""

import numpy as np
import pytest

from areal_mega.dataplane import Trajectory, TrajectoryError
from areal_mega.dataplane import trajectory as trajectory_mod


def make(n_prompt=3, n_gen=4, **kw):
    return Trajectory.from_tokens(
        np.arange(1, n_prompt + 1),
        np.arange(10, 10 + n_gen),
        -np.linspace(0.1, 1.0, n_gen),
        [2] * (n_gen - 1) + [3],
        reward=1.0,
        sample_id="s0",
        group_id="g0",
        **kw,
    )


def test_from_tokens_layout_and_dtypes():
    t = make().validate()
    assert t.length == 7 and t.prompt_len == 3 and t.completion_len == 4
    assert t.input_ids.dtype == np.int32 and t.loss_mask.dtype == np.uint8
    assert t.logprobs.dtype == np.float32 and t.versions.dtype == np.int32
    assert t.reward.dtype == np.float32 and t.reward.shape == ()
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert t.versions.tolist() == [-1, -1, -1, 2, 2, 2, 3]
    assert t.logprobs[:3].tolist() == [0, 0, 0]
    assert (t.min_version, t.max_version) == (2, 3)
    assert t.total_reward == 1.0 and not t.per_token_reward


def test_dict_roundtrip_with_extras():
    t = make(token_extras={"ref_logprobs": np.zeros(7, np.float32)}, meta={"k": [1, "x"]})
    u = Trajectory.from_dict(t.to_dict()).validate()
    assert u.equals(t)
    assert list(u.token_extras) == ["ref_logprobs"]
    u.meta["k"] = 2
    assert not u.equals(t)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda t: setattr(t, "loss_mask", np.ones(7, np.uint8)), "loss_mask"),  # 1 on prompt
        (lambda t: setattr(t, "loss_mask", np.full(7, 2, np.uint8)), "loss_mask"),
        (lambda t: setattr(t, "logprobs", np.full(7, np.nan, np.float32)), "logprobs"),
        (lambda t: setattr(t, "logprobs", np.full(7, 0.5, np.float32)), "logprobs"),
        (lambda t: setattr(t, "versions", np.full(7, -5, np.int32)), "versions"),
        (lambda t: setattr(t, "versions", np.zeros(6, np.int32)), "versions"),
        (lambda t: setattr(t, "input_ids", np.full(7, -1, np.int32)), "input_ids"),
        (lambda t: setattr(t, "input_ids", np.zeros(7, np.int64)), "input_ids"),
        (lambda t: setattr(t, "reward", np.float32(np.inf)), "reward"),
        (lambda t: setattr(t, "reward", np.zeros(3, np.float32)), "reward"),
        (lambda t: setattr(t, "prompt_len", 9), "prompt_len"),
        (lambda t: setattr(t, "finish_reason", "eos"), "finish_reason"),
        (lambda t: setattr(t, "sample_id", ""), "sample_id"),
        (lambda t: setattr(t, "created_at", float("nan")), "created_at"),
        (lambda t: setattr(t, "meta", [1]), "meta"),
        (lambda t: t.token_extras.update(values=np.zeros(3, np.float32)), "token_extras.values"),
        (lambda t: t.token_extras.update(reward=np.zeros(7, np.float32)), "token_extras.reward"),
        (lambda t: t.token_extras.update(x=np.zeros(7, np.complex64)), "token_extras.x"),
    ],
)
def test_validate_names_the_field(mutate, field):
    t = make()
    mutate(t)
    with pytest.raises(TrajectoryError) as e:
        t.validate()
    assert e.value.field == field
    assert repr(field) in str(e.value)


def test_float_ids_are_refused_at_construction():
    with pytest.raises(TrajectoryError, match="input_ids"):
        Trajectory(
            input_ids=np.zeros(3, np.float32),
            loss_mask=[0, 0, 0],
            logprobs=[0, 0, 0],
            versions=[-1, -1, -1],
            sample_id="a",
        )


def test_per_token_reward():
    t = make()
    t.reward = np.arange(7, dtype=np.float32)
    t.validate()
    assert t.per_token_reward and t.total_reward == 21.0


def _core(n=40, n_prompt=10, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, n).astype(np.int32)
    mask = (np.arange(n) >= n_prompt).astype(np.uint8)
    lp = np.where(mask == 1, -rng.random(n), 0.0).astype(np.float32)
    ver = np.where(mask == 1, rng.integers(0, 5, n), -1).astype(np.int32)
    return ids, mask, lp, ver


def _rule_breaks():
    """(name, expected bits, (ids, mask, logprobs, versions, prompt_len)) for every rule alone,
    combinations, and the edge values right at each bound."""
    tr = trajectory_mod
    cases = [
        ("valid", 0, (*_core(), 10)),
        ("valid_no_prompt", 0, (*_core(n_prompt=0), 0)),
        ("valid_all_prompt", 0, (*_core(n_prompt=40), 40)),
        ("valid_one", 0, (*_core(1, 0), 0)),
    ]

    def broken(name, bits, edit, prompt_len=10, n=40):
        arrays = [a.copy() for a in _core(n)]
        edit(*arrays)
        cases.append((name, bits, (*arrays, prompt_len)))

    broken("id_min_int", tr.NEGATIVE_ID, lambda i, m, lp, v: i.__setitem__(39, -(2**31)))
    broken("id_zero_ok", 0, lambda i, m, lp, v: i.__setitem__(0, 0))
    broken("mask_2", tr.MASK_NOT_BINARY, lambda i, m, lp, v: m.__setitem__(20, 2))
    broken(
        "mask_255_on_prompt",
        tr.MASK_NOT_BINARY | tr.MASK_ON_PROMPT,
        lambda i, m, lp, v: m.__setitem__(3, 255),
    )
    broken("version_-2", tr.VERSION_BELOW, lambda i, m, lp, v: v.__setitem__(0, -2))
    broken("version_-1_ok", 0, lambda i, m, lp, v: v.__setitem__(30, -1))
    broken("mask_on_last_prompt", tr.MASK_ON_PROMPT, lambda i, m, lp, v: m.__setitem__(9, 1))
    broken("mask_after_prompt_ok", 0, lambda i, m, lp, v: m.__setitem__(10, 1))
    for bad in (np.nan, np.inf, -np.inf, 1e-30, 0.5):
        broken(f"logprob_{bad}", tr.BAD_LOGPROB, lambda i, m, lp, v, b=bad: lp.__setitem__(25, b))
        broken(
            f"logprob_{bad}_masked_out_ok", 0, lambda i, m, lp, v, b=bad: lp.__setitem__(5, b)
        )  # prompt token: not checked
    broken("logprob_zero_ok", 0, lambda i, m, lp, v: lp.__setitem__(25, 0.0))
    broken("logprob_-0_ok", 0, lambda i, m, lp, v: lp.__setitem__(25, -0.0))
    broken(
        "everything",
        tr.NEGATIVE_ID | tr.VERSION_BELOW | tr.MASK_ON_PROMPT | tr.BAD_LOGPROB,
        lambda i, m, lp, v: (
            i.__setitem__(1, -1),
            v.__setitem__(2, -7),
            m.__setitem__(0, 1),
            lp.__setitem__(0, np.nan),
        ),
    )
    # a long array with the bad value at the very end
    broken("long_bad_tail", tr.BAD_LOGPROB, lambda i, m, lp, v: lp.__setitem__(-1, 2.0), n=1 << 17)
    return cases


@pytest.mark.parametrize(
    "name, bits, args", _rule_breaks(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_value_checks_name_every_broken_rule(name, bits, args):
    tr = trajectory_mod
    assert tr.failed_value_rules(*args) == bits
    # frames arrive at any byte offset: the check must not assume alignment
    unaligned = []
    for a in args[:4]:
        raw = np.zeros(a.nbytes + 1, np.uint8)
        raw[1:] = a.view(np.uint8)
        unaligned.append(np.frombuffer(raw.data, a.dtype, a.size, 1))
    assert tr.failed_value_rules(*unaligned, args[4]) == bits


def test_value_checks_take_strided_views():
    ids, mask, lp, ver = (np.repeat(a, 2)[::2] for a in _core())
    lp[25] = np.nan
    assert trajectory_mod.failed_value_rules(ids, mask, lp, ver, 10) == trajectory_mod.BAD_LOGPROB

"""Trajectory construction and validation: every rule names the bad field."""
import numpy as np
import pytest

from areal_mega.dataplane import Trajectory, TrajectoryError


def make(n_prompt=3, n_gen=4, **kw):
    return Trajectory.from_tokens(np.arange(1, n_prompt + 1), np.arange(10, 10 + n_gen),
                                  -np.linspace(0.1, 1.0, n_gen), [2] * (n_gen - 1) + [3],
                                  reward=1.0, sample_id="s0", group_id="g0", **kw)


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


@pytest.mark.parametrize("mutate, field", [
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
])
def test_validate_names_the_field(mutate, field):
    t = make()
    mutate(t)
    with pytest.raises(TrajectoryError) as e:
        t.validate()
    assert e.value.field == field
    assert repr(field) in str(e.value)


def test_float_ids_are_refused_at_construction():
    with pytest.raises(TrajectoryError, match="input_ids"):
        Trajectory(input_ids=np.zeros(3, np.float32), loss_mask=[0, 0, 0], logprobs=[0, 0, 0],
                   versions=[-1, -1, -1], sample_id="a")


def test_per_token_reward():
    t = make()
    t.reward = np.arange(7, dtype=np.float32)
    t.validate()
    assert t.per_token_reward and t.total_reward == 21.0

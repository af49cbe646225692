"""Pure parts of the rollout package: staleness accounting, weight-bucket planning, reward
helpers and the SGLang command line. No servers."""

import pytest

from areal_mega.backends.sglang import build_sglang_command
from areal_mega.rewards import (
    TimeoutWorkerPool,
    exact_match_reward,
    extract_boxed,
    load_reward_fn,
    math_reward,
    shutdown_reward_workers,
)
from areal_mega.rollout.staleness import (
    StalenessCounter,
    may_start,
    rollout_capacity,
    sample_version,
    staleness,
)
from areal_mega.train.weight_sender import plan_weight_buckets, tensor_nbytes


def test_capacity_formula():
    assert rollout_capacity(0, 0, 0, batch_size=4, eta=0) == 4
    assert rollout_capacity(0, 2, 2, batch_size=4, eta=0) == 0
    assert rollout_capacity(1, 2, 2, batch_size=4, eta=0) == 4
    assert rollout_capacity(0, 0, 0, batch_size=4, eta=2) == 12
    assert rollout_capacity(0, 10, 10, batch_size=4, eta=0) == 0  # never negative
    assert may_start(3, 15, 0, 4, 0) and not may_start(3, 16, 0, 4, 0)
    with pytest.raises(ValueError):
        rollout_capacity(0, 0, 0, batch_size=0, eta=0)


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_counter_simulated_in_order_consumption(eta):
    """Simulate the controller and an in-order trainer: no consumed group is staler than eta."""
    B = 3
    c = StalenessCounter(batch_size=B, eta=eta)
    started = []  # start versions in start order
    for step in range(12):
        while c.capacity() > 0:
            c.on_start()
            started.append(c.version)
        # all running groups finish
        while c.running:
            c.on_finish()
        batch = started[step * B : (step + 1) * B]
        assert all(c.version - v <= eta for v in batch)
        assert max(c.version - v for v in batch) == min(eta, step)
        c.set_version(c.version + 1)
    with pytest.raises(ValueError):
        c.set_version(0)


def test_counter_rejected_frees_slots():
    c = StalenessCounter(batch_size=2, eta=0)
    c.on_start()
    c.on_start()
    with pytest.raises(RuntimeError):
        c.on_start()
    c.on_finish(accepted=False)
    assert c.capacity() == 1
    c.on_finish(accepted=True)
    c.on_rejected(1)
    assert c.capacity() == 2 and c.rejected == 2


def test_sample_version_and_staleness():
    assert sample_version([-1, -1, 3, 3, 4]) == 3
    assert sample_version([-1, -1]) == -1
    assert staleness(5, [-1, 3, 4]) == 2


def test_plan_weight_buckets():
    items = [
        ("a", (4, 4), "float32"),
        ("b", (4,), "float32"),
        ("c", (100,), "bfloat16"),
        ("d", (2, 2), "torch.float32"),
    ]
    assert tensor_nbytes((4, 4), "float32") == 64
    plan = plan_weight_buckets(items, bucket_bytes=80)
    assert [[n for n, _, _ in b] for b in plan] == [["a", "b"], ["c"], ["d"]]
    assert plan[2][0][2] == "float32"
    assert sum(len(b) for b in plan_weight_buckets(items, 1)) == 4  # one tensor per bucket
    assert len(plan_weight_buckets(items, 1 << 30)) == 1
    assert plan_weight_buckets([], 10) == []
    with pytest.raises(ValueError, match="duplicate"):
        plan_weight_buckets([("a", (1,), "float32")] * 2, 10)
    with pytest.raises(ValueError, match="dtype"):
        plan_weight_buckets([("a", (1,), "complex32")], 10)


def test_extract_boxed_and_exact_match():
    assert extract_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed("no box") is None
    assert extract_boxed(r"\boxed{unclosed") is None
    assert exact_match_reward("p", "54321", "54321") == 1.0
    assert exact_match_reward("p", "54321", "54321", finish_reason="length") == 0.0


def test_load_reward_fn_errors():
    assert load_reward_fn("areal_mega.rewards:math_reward") is math_reward
    assert load_reward_fn("areal_mega.rewards.exact_match_reward") is exact_match_reward
    for bad in ["", "nodots", "no_such_module_xyz:f", "areal_mega.rewards:nope"]:
        with pytest.raises(ValueError, match="reward_fn"):
            load_reward_fn(bad)


def test_math_reward_and_timeout():
    try:
        assert math_reward("q", r"The answer is \boxed{\frac{1}{2}}", "0.5") == 1.0
        assert math_reward("q", r"\boxed{3}", "4") == 0.0
        assert math_reward("q", "no box at all", "4") == 0.0
    finally:
        shutdown_reward_workers()
    pool = TimeoutWorkerPool(n_workers=1)
    try:
        with pytest.raises(TimeoutError):
            pool.call("time:sleep", (30,), timeout_s=1.0)  # a hung verifier is killed
        assert pool.timeouts == 1
        assert pool.call("math:sqrt", (16.0,), timeout_s=30) == 4.0  # the replacement works
    finally:
        pool.close()


def test_sglang_command():
    cmd = build_sglang_command(
        "/m", 30001, tp=2, dp=1, mem_fraction_static=0.7, dtype="bf16", api_key="k"
    )
    s = " ".join(cmd)
    assert "-m sglang.launch_server --model-path /m" in s
    for frag in [
        "--port 30001",
        "--tp-size 2",
        "--dp-size 1",
        "--mem-fraction-static 0.7",
        "--dtype bfloat16",
        "--api-key k",
    ]:
        assert frag in s
    with pytest.raises(ValueError):
        build_sglang_command("/m", 1, dtype="int4")


def test_eos_drawn_as_the_last_allowed_token_is_a_stop():
    """SGLang reports ``length`` when EOS is the max_new_tokens-th token (it checks the limit
    first); the trajectory records that the model ended the sample."""
    from types import SimpleNamespace

    from areal_mega.rollout.controller import model_finish

    tok = SimpleNamespace(eos_token_id=2)
    assert model_finish("length", [5, 6, 2], {}, tok) == "stop"
    assert model_finish("length", [5, 6, 7], {}, tok) == "length"
    assert model_finish("length", [5, 9], {"stop_token_ids": [9]}, tok) == "stop"
    assert model_finish("length", [5, 2], {"ignore_eos": True}, tok) == "length"
    assert model_finish("length", [], {}, tok) == "length"
    assert model_finish("abort", [2], {}, tok) == "abort"
    assert model_finish("length", [4], {}, SimpleNamespace(eos_token_id=[3, 4])) == "stop"

"""RL with images end to end on the CPU: 5 GRPO steps of a tiny Qwen2.5-VL on the synthetic
counting task (:mod:`areal_mega.data.synthetic_vision`) through ``launch.local`` (CPU rollout
server sent each prompt's images, rollout worker encoding each drawn prompt once, trainer
packing the images with the samples). Every step's server logprobs equal the trainer's
(``mismatch`` <= 1e-5 on the tokens of the weights the trainer holds: the trainer's forward saw
the very images the server saw), the weights moved, and the held-out images were evaluated at
steps 0 and 5 (``eval/*``); on policy at DP2, at trainer TP2 and PP2 (the weights gathered from
their TP shards and pipeline stages) and with the distributed weight update (the vision and
language tensors broadcast to the server by name) too."""

import pytest

from areal_mega.data.synthetic_vision import write_task
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.convert_worker import compare, load_all
from tests.helpers.local_runs import _finish, _launch, _metrics

pytestmark = pytest.mark.slow
TOL = 1e-5


def _vl_run(tmp_path, steps: int, *extra, arch: str = "qwen2_5_vl", weight_update="disk"):
    """``steps`` GRPO steps of a tiny VL model (``arch``, Qwen2.5-VL by default) on the counting
    task, weights published (``weight_update``) after every step, no staleness; returns
    (model, data, run_dir, metrics rows)."""
    # digits and "=" only, as the text families' RL check: an untrained model's first digit is
    # the count now and then, so char_match_reward gives the groups a learning signal
    model = make_tiny_model(tmp_path / "model", arch=arch, charset="digits", seed=3)
    data = write_task(tmp_path / "data", "count", n_train=32, n_test=4, seed=0, question="=")
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run,
            model,
            data,
            f"total_steps={steps}",
            "recover=off",
            "rollout.max_head_offpolicyness=0",
            f"rollout.weight_update={weight_update}",
            "rollout.reward_fn=areal_mega.rewards:char_match_reward",
            "rollout.seeded_sampling=true",
            "data.apply_chat_template=true",
            "data.max_prompt_len=64",
            "optimizer.lr=1e-2",
            "optimizer.warmup_steps=0",
            *extra,
        ),
        timeout=600,
    )
    assert rc == 0, out[-3000:]
    return model, data, run, _metrics(run)


def _check_on_policy(rows) -> None:
    for r in rows:
        assert r["mismatch_tokens"] > 0 and r["mismatch"] <= TOL, (r["step"], r["mismatch"])
    assert any(r.get("grad_norm", 0) > 0 for r in rows)


def test_rl_steps_with_images_on_policy_through_the_cpu_server(tmp_path):
    model, data, run, rows = _vl_run(
        tmp_path,
        5,
        f"eval.data={tmp_path / 'data' / 'test.jsonl'}",  # evaluation with images in training
        "eval.every_steps=5",
        "eval.n_samples=2",
    )
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 5]
    for r in evals:
        assert r["eval/version"] == r["step"] and r["eval/n_prompts"] == 4
        assert r["eval/n_samples"] == 2 and 0 < r["eval/response_len"] <= 6
    _check_on_policy(rows[1:])
    published = sorted((run / "weights").glob("v*"))
    assert published, "no weights published"
    assert compare(load_all(model), load_all(published[-1])), "the weights did not move"


def test_rl_steps_with_images_at_dp2(tmp_path):
    """Two data-parallel trainer ranks: the one-rank start checkpoint loads, the images travel
    with their samples to each rank, rank 0 publishes the weights; on policy every step."""
    _, _, _, rows = _vl_run(tmp_path, 3, "allocation=local:d1+megatron:d2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_on_policy(rows)


@pytest.mark.parametrize("layout", ["t2", "p2"])
def test_rl_steps_with_images_at_trainer_tp2_and_pp2(tmp_path, layout):
    """Trainer TP2 / PP2: the one-rank start checkpoint resharded, the published weights
    gathered from the TP shards / written by each pipeline stage (the vision tower from the
    first); on policy every step, and the weights moved."""
    model, _, run, rows = _vl_run(tmp_path, 3, f"allocation=local:d1+megatron:{layout}")
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_on_policy(rows)
    published = sorted((run / "weights").glob("v*"))
    assert published, "no weights published"
    assert compare(load_all(model), load_all(published[-1])), "the weights did not move"


@pytest.mark.parametrize(
    "arch,layout", [("qwen2_5_vl", "d1"), ("qwen2_5_vl", "t2"), ("qwen3_vl", "t2")]
)
def test_rl_steps_with_images_by_the_distributed_weight_update(tmp_path, arch, layout):
    """The distributed weight update (gloo on the CPU), from one trainer rank and from TP2 (both
    ranks gather, rank 0 sends; Qwen3-VL's tower is split over TP too): the trainer broadcasts
    the vision tower, projector and language model by HF name in buckets, the server loads
    them under its own names; on policy every step (the server's logprobs are the trainer's
    weights'), no weight directory written."""
    _, _, run, rows = _vl_run(
        tmp_path,
        3,
        f"allocation=local:d1+megatron:{layout}",
        "rollout.weight_bucket_mb=1",
        arch=arch,
        weight_update="distributed",
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_on_policy(rows)
    assert not sorted((run / "weights").glob("v*")), "published by disk"


def test_qwen3_vl_rl_steps_with_images_on_policy(tmp_path):
    """Qwen3-VL (16-pixel patches, deepstack, interleaved multimodal RoPE): 5 GRPO steps with
    images through the CPU server, on policy every step (the server's positions and vision
    features equal the trainer's), and the weights published through the bridge's Qwen3-VL
    table moved."""
    model, _, run, rows = _vl_run(tmp_path, 5, arch="qwen3_vl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    _check_on_policy(rows)
    published = sorted((run / "weights").glob("v*"))
    assert published, "no weights published"
    start, last = load_all(model), load_all(published[-1])
    assert set(start) == set(last)  # the HF names of every tensor
    assert compare(start, last), "the weights did not move"

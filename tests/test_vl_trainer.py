"""Images through the trainer's batching (contract C2): packed micro-batches carry their
samples' pixel_values / image_grid_thw in packed order (each sample of a group its own grid),
selecting and splitting sequences moves their images along, the token budget counts the
vision tower's work, DP balancing keeps images with their samples, and the engines that could
not see a vision-language student's images are refused by name. The 2-rank equalities of a
real step on the tiny Qwen2.5-VL are in tests/test_vl_trainer_layouts.py."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from areal_mega.algo.batch import PackedBatch
from areal_mega.algo.packing import select_sequences, split_micro_batches
from areal_mega.config import ConfigError, load_config
from areal_mega.scheduler import PlanError
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train import batches
from areal_mega.train.teacher import vision_of
from areal_mega.workflow.tokens import TokenSeq
from tests.helpers.trajectories import make_traj
from tests.helpers.vl_trajectories import SPEC, make_vl_traj

GRIDS = {0: ((1, 2, 4),), 1: ((1, 4, 4), (1, 2, 2)), 2: ()}  # per group: its prompt's images


def _groups(n=3, n_groups=3):
    """``n_groups`` prompt groups of ``n`` samples; group g's samples share its prompt's
    images (same pixels: one prompt), each sample its own copy."""
    out = []
    for g in range(n_groups):
        for k in range(n):
            t = make_vl_traj(
                10 * g + k,
                GRIDS[g % 3],
                n_completion=3 + 2 * k,
                sample_id=f"g{g}-s{k}",
                group_id=f"g{g}",
                reward=float(k % 2),
            )
            if k:  # the group's prompt (tokens and images) for every sample, each its own copy
                t.input_ids[: t.prompt_len] = out[-k].input_ids[: t.prompt_len]
                if t.multimodal:
                    t.multimodal["pixel_values"] = out[-k].multimodal["pixel_values"].copy()
            out.append(t.validate())
    return out


def _images_of(mb, b):
    """Sequence b's (pixel_values, image_grid_thw) in packed micro-batch ``mb``."""
    counts = mb["image_counts"].tolist()
    first = sum(counts[:b])
    grid = mb["image_grid_thw"][first : first + counts[b]]
    patches = mb["image_grid_thw"].prod(-1).tolist()
    row = sum(patches[:first])
    return mb["pixel_values"][row : row + int(grid.prod(-1).sum())], grid


def _assert_carries_its_images(mb, by_id):
    for b, sid in enumerate(mb["sample_ids"]):
        pixels, grid = _images_of(mb, b)
        t = by_id[sid]
        if t.multimodal:
            assert grid.tolist() == t.multimodal["image_grid_thw"].tolist(), sid
            assert torch.equal(pixels, torch.from_numpy(t.multimodal["pixel_values"])), sid
        else:
            assert len(grid) == 0 and len(pixels) == 0, sid
    assert int(mb["image_counts"].sum()) == len(mb["image_grid_thw"])


def test_packed_micro_batch_carries_each_samples_images_in_packed_order():
    trajs = _groups()
    by_id = {t.sample_id: t for t in trajs}
    packed = pack_sequences(trajs, pad_to_multiple=4)
    mb = PackedBatch.from_packed(
        pack_sequences(
            [batches.next_token_sample(t, np.zeros(t.length, np.float32)) for t in trajs],
            pad_to_multiple=4,
        )
    )
    for batch in (packed, mb):
        # n samples of a group: the group's grid n times, once per sample
        assert batch["image_counts"].tolist() == [1, 1, 1, 2, 2, 2, 0, 0, 0]
        assert batch["image_grid_thw"].tolist() == [[1, 2, 4]] * 3 + [[1, 4, 4], [1, 2, 2]] * 3
        assert batch["image_grid_thw"].dtype == torch.int64
        assert batch["pixel_values"].shape == (3 * 8 + 3 * 20, SPEC.patch_dim)
        _assert_carries_its_images(batch, by_id)
    # selecting / splitting sequences moves their images with them
    picked = select_sequences(packed, [5, 0, 7])
    assert picked["image_counts"].tolist() == [2, 1, 0]
    _assert_carries_its_images(picked, by_id)
    parts = split_micro_batches(packed, 3)
    assert [p["image_counts"].tolist() for p in parts] == [[1, 1, 1], [2, 2, 2], [0, 0, 0]]
    for p in parts:
        _assert_carries_its_images(p, by_id)
    text = pack_sequences([make_traj(0, 1), make_traj(0, 2)])
    assert "pixel_values" not in text and "image_counts" not in text
    with pytest.raises(ValueError, match="image_counts"):
        dataclasses.replace(mb, image_counts=mb.image_counts[:-1])
    with pytest.raises(ValueError, match="sum\\(t\\*h\\*w\\)"):
        dataclasses.replace(mb, pixel_values=mb.pixel_values[:-1])
    with pytest.raises(ValueError, match="go together"):
        dataclasses.replace(mb, image_grid_thw=None)


def _cost(t):
    return t.length + int((t.input_ids == SPEC.image_token_id).sum())


def test_plan_step_balances_images_with_their_samples_and_budgets_vision_work():
    trajs = _groups(n=4, n_groups=6)
    by_id = {t.sample_id: t for t in trajs}
    cfg = load_config(None, ["scheduler.max_tokens_per_mb=64", "rollout.n_samples=4"])
    plan = batches.plan_step(trajs, cfg, dp_size=2, tp_size=2, pp_size=1, cp_size=1, vision=SPEC)
    seen = []
    for rank in plan.micro_batches:
        assert len(rank) == len(plan.micro_batches[0]) > 1
        for mb in rank:
            assert isinstance(mb, PackedBatch)
            if mb.n_seqs:
                _assert_carries_its_images(mb, by_id)
            seen += mb.sample_ids
            # the budget: tokens plus one per merged patch of the vision tower's work (the
            # number of placeholders)
            assert sum(_cost(by_id[s]) for s in mb.sample_ids) <= 64
    assert sorted(seen) == sorted(by_id)
    assert plan.stats["n_images"] == 2 * 4 * 3  # 1 + 2 + 0 images per group, two of each
    assert batches.budget_lengths(trajs, SPEC) == [_cost(t) for t in trajs]
    assert [_cost(t) - t.length for t in trajs[:12]] == [2] * 4 + [5] * 4 + [0] * 4
    assert batches.budget_lengths(trajs[:3]) == [t.length for t in trajs[:3]]
    big = make_vl_traj(99, ((1, 8, 8),), n_completion=2)  # 24 tokens + 16 for the tower
    assert big.length == 24
    small = load_config(None, ["scheduler.max_tokens_per_mb=32"])
    batches.plan_step([big], small, dp_size=1, tp_size=1, pp_size=1, cp_size=1)  # text budget
    with pytest.raises(PlanError, match="length 40 exceeds max_tokens_per_mb=32.*vision tower"):
        batches.plan_step([big], small, dp_size=1, tp_size=1, pp_size=1, cp_size=1, vision=SPEC)
    # the same trajectories without the vision budget fit in fewer micro-batches
    fewer = batches.plan_step(trajs, cfg, dp_size=2, tp_size=2, pp_size=1, cp_size=1)
    assert len(fewer.micro_batches[0]) < len(plan.micro_batches[0])


def test_token_seq_and_context_carry_the_images():
    t = make_vl_traj(3)
    seq = TokenSeq()
    seq.add_context(t.input_ids[: t.prompt_len].tolist())
    seq.add_generated(
        t.input_ids[t.prompt_len :].tolist(),
        t.logprobs[t.prompt_len :].tolist(),
        [0] * t.completion_len,
    )
    mm = {
        k: torch.from_numpy(v.astype(np.float64 if k == "pixel_values" else np.int64))
        for k, v in t.multimodal.items()
    }
    out = seq.to_trajectory(
        reward=1.0,
        sample_id="x",
        group_id="g",
        prompt_len=t.prompt_len,
        finish_reason="stop",
        multimodal=mm,
    ).validate()
    assert out.multimodal["pixel_values"].dtype == np.float32
    assert out.multimodal["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert np.array_equal(out.multimodal["pixel_values"], t.multimodal["pixel_values"])


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_engines_that_cannot_see_the_images_are_refused_by_name(tmp_path):
    from areal_mega.models.tiny import make_tiny_model
    from areal_mega.models.vlm.config import vision_spec

    vl = json.loads(
        (make_tiny_model(tmp_path / "vl", arch="qwen2_5_vl") / "config.json").read_text()
    )
    text = json.loads((make_tiny_model(tmp_path / "text") / "config.json").read_text())
    assert vision_of(_cfg(), text, ref_hf=vl) is None  # a text student: no images anywhere
    assert vision_of(_cfg(), vl, ref_hf=vl, teacher_hf=vl) == vision_spec(vl)
    with pytest.raises(ConfigError, match="ref.path: a text model"):
        vision_of(_cfg(), vl, ref_hf=text)
    with pytest.raises(ConfigError, match="teacher.path: a text model"):
        vision_of(_cfg(), vl, teacher_hf=text)
    # a served teacher is checked when reached (a VL model of the same image processor)
    served = _cfg("algorithm.opd=pure", "teacher.server_addrs=[http://x:1]")
    assert vision_of(served, vl) == vision_spec(vl)
    # the critic is the student's VL model with a value head (tests/test_vl_critic.py)
    critic = _cfg("critic.enabled=true", "algorithm.adv_estimator=gae")
    assert vision_of(critic, vl) == vision_spec(vl)


def test_intake_journals_images_and_a_resume_replays_them(tmp_path):
    """The trainer intake of a VL student (vision=SPEC): groups with images arrive over the
    socket, a sample whose placeholders do not match its images is refused (invalid_field),
    the accepted ones are journaled; a resumed intake replays them bit for bit. A text
    student's intake refuses every sample with images and takes the text ones."""
    from areal_mega.dataplane import TrajectorySender
    from areal_mega.train.intake import TrajectoryIntake

    trajs = _groups(n=3, n_groups=3)  # g0, g1 with images, g2 text
    bad = make_vl_traj(50, sample_id="bad", group_id="g9")
    bad.input_ids[1] = SPEC.image_token_id  # one placeholder too many
    run = tmp_path / "run"
    intake = TrajectoryIntake(f"ipc://{tmp_path}/a.sock", run, group_size=3, vision=SPEC).start()
    try:
        with TrajectorySender(intake.receiver.endpoint) as tx:
            for t in [bad, *trajs]:
                tx.send(t)
        got = intake.next_groups(3, timeout=60)
        assert sorted(t.sample_id for t in got) == sorted(t.sample_id for t in trajs)
        assert intake.stats()["dataplane/rejected_total"] == 1.0
        assert intake.receiver.rejected == {"invalid_field": 1}
    finally:
        intake.close()
    resumed = TrajectoryIntake(f"ipc://{tmp_path}/b.sock", run, group_size=3, vision=SPEC)
    try:
        assert resumed.restore(None, 0) == len(trajs)
        by_id = {t.sample_id: t for t in trajs}
        back = resumed.buffer.pending()
        assert len(back) == len(trajs) and all(t.equals(by_id[t.sample_id]) for t in back)
    finally:
        resumed.close()
    text = TrajectoryIntake(f"ipc://{tmp_path}/c.sock", tmp_path / "run2", group_size=3).start()
    try:
        with TrajectorySender(text.receiver.endpoint) as tx:
            for t in trajs:
                tx.send(t)
        got = text.next_groups(1, timeout=60)  # the text group only
        assert {t.group_id for t in got} == {"g2"}
        assert text.receiver.rejected == {"invalid_field": 6}
    finally:
        text.close()

"""PackedBatch invariants: declared fields only, shapes checked, attach returns new batches, and
the loss reads a PackedBatch exactly as it reads the packed dict it came from."""

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from areal_mega.algo import make_policy_loss, with_algo_fields
from areal_mega.algo.batch import PackedBatch
from areal_mega.config import AlgorithmConfig
from areal_mega.engine.loss_context import loss_view
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train import batches


def samples():
    out = []
    for i, (n, g) in enumerate([(5, "g0"), (4, "g0"), (6, "g1")]):
        lm = np.ones(n, np.uint8)
        lm[:2] = 0
        lm[-1] = 0
        out.append(
            {
                **batches.next_token_layout(np.arange(n) + i),
                "loss_mask": lm,
                "logprobs": np.linspace(-1, -0.1, n).astype(np.float32),
                "versions": np.full(n, i, np.int32),
                "advantages": np.full(n, 0.5 - i, np.float32),
                "prompt_len": 2,
                "reward": float(i),
                "sample_id": f"s{i}",
                "group_id": g,
                "finish_reason": "length" if i == 1 else "stop",
            }
        )
    return out


def test_from_packed_keeps_one_name_per_field_and_checks_shapes():
    packed = pack_sequences(samples(), pad_to_multiple=4)
    b = PackedBatch.from_packed(packed)
    assert b.n_tokens == 16 and b.n_seqs == 3
    assert "behav_logprobs" not in b and "token_keys" not in b  # one name: the trajectory's
    assert b["logprobs"] is packed["logprobs"]
    assert b.group_index.tolist() == [0, 0, 1]
    assert b.seq_no_eos.tolist() == [False, True, False]
    assert b.response_lens.tolist() == [3, 2, 4]
    assert b.get("prox_logprobs") is None and "prox_logprobs" not in b
    with pytest.raises(ValueError, match="per-token field 'advantages'"):
        dataclasses.replace(b, advantages=torch.zeros(3))
    with pytest.raises(ValueError, match="per-sequence field 'group_index'"):
        dataclasses.replace(b, group_index=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="undeclared packed fields"):
        PackedBatch.from_packed({**packed, "surprise": torch.zeros(3)})
    no_labels = {k: v for k, v in packed.items() if k != "labels"}
    with pytest.raises(ValueError, match=r"lacks the fields \['labels'\]"):
        PackedBatch.from_packed(no_labels)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.advantages = torch.zeros(16)


def test_attach_returns_new_batches_and_rejects_other_fields():
    b = PackedBatch.from_packed(pack_sequences(samples(), pad_to_multiple=4))
    [c] = batches.attach([b], prox_logprobs=[np.zeros(16, np.float32)], policy_version=[7])
    assert "prox_logprobs" not in b and b.policy_version is None
    assert isinstance(c.prox_logprobs, torch.Tensor) and c["policy_version"] == 7
    with pytest.raises(ValueError, match="per-token field 'ref_logprobs'"):
        b.with_fields(ref_logprobs=torch.zeros(5))
    with pytest.raises(ValueError, match="cannot be attached"):
        b.with_fields(loss_mask=torch.zeros(16))  # planned, not attachable
    with pytest.raises(ValueError, match="2 values"):
        batches.attach([b], prox_logprobs=[torch.zeros(16)] * 2)
    again = pickle.loads(pickle.dumps(c))  # what distribute sends
    assert torch.equal(again.prox_logprobs, c.prox_logprobs) and again.sample_ids == c.sample_ids


def test_loss_reads_a_packed_batch_like_the_dict():
    packed = pack_sequences(samples(), pad_to_multiple=4)
    prox = torch.linspace(-1.2, -0.2, 16)
    typed = PackedBatch.from_packed(packed).with_fields(prox_logprobs=prox, policy_version=1)
    plain = {**with_algo_fields(packed), "prox_logprobs": prox, "policy_version": 1}
    cfg = dataclasses.replace(AlgorithmConfig(), kl_coef=0.0)
    loss_fn, den_fn = make_policy_loss(cfg)
    lp = torch.linspace(-0.9, -0.3, 16)
    num_t, st_t = loss_fn(lp, None, loss_view(typed, torch.device("cpu")))
    num_p, st_p = loss_fn(lp, None, loss_view(plain, torch.device("cpu")))
    assert den_fn(typed) == den_fn(plain) > 0
    assert float(num_t) == float(num_p) and float(num_t) != 0.0
    assert {k: float(v) for k, v in st_t.items()} == {k: float(v) for k, v in st_p.items()}


def test_plan_step_shifts_every_field_once_into_next_token_layout():
    from areal_mega.config import load_config
    from areal_mega.dataplane import Trajectory
    from areal_mega.train.sft import sft_sample

    trajs = [
        Trajectory.from_tokens(
            [1, 2, 3],
            [4 + i, 5, 6],
            [-0.5, -0.25 * i, -0.125],
            [2, 3, 3],
            reward=float(i),
            sample_id=f"s{i}",
            group_id="g",
        )
        for i in range(2)
    ]
    cfg = load_config(None, [])
    plan = batches.plan_step(trajs, cfg, dp_size=1, tp_size=8, pp_size=1, cp_size=1)
    [[mb]] = plan.micro_batches
    assert isinstance(mb, PackedBatch) and plan.sample_ids == ["s0", "s1"]
    for b, t in enumerate(trajs):
        lo, hi = int(mb.cu_seqlens[b]), int(mb.cu_seqlens[b + 1])
        assert mb.input_ids[lo:hi].tolist() == t.input_ids.tolist()  # not shifted
        assert mb.labels[lo:hi].tolist() == t.input_ids[1:].tolist() + [-1]  # the shift
        assert mb.loss_mask[lo:hi].tolist() == t.loss_mask[1:].tolist() + [0]
        assert mb.logprobs[lo:hi].tolist() == t.logprobs[1:].tolist() + [0.0]
        assert mb.versions[lo:hi].tolist() == t.versions[1:].tolist() + [-1]
        assert mb.advantages[hi - 1] == 0.0 and mb.advantages[lo + 2] != 0.0
    s = sft_sample([7, 8], [9, 10], eos_id=11)  # SFT: the same single shift
    assert s["input_ids"].tolist() == [7, 8, 9, 10, 11]
    assert s["loss_mask"].tolist() == [0, 1, 1, 1, 0]
    assert s["labels"].tolist() == [8, 9, 10, 11, -1]
    assert mb.n_tokens == 16 and mb.labels[12:].tolist() == [-1] * 4  # padding (TP=8)


def test_minibatches_keep_a_multiple_of_pp_for_the_interleaved_schedule():
    mbs = list(range(6))
    assert batches.minibatches(mbs, 4) == [[0, 1], [2], [3], [4, 5]]
    # PP=2 with VPP: whole groups of two only, fewer minibatches when there are fewer groups
    assert batches.minibatches(mbs, 2, multiple_of=2) == [[0, 1, 2, 3], [4, 5]]
    assert batches.minibatches(mbs, 4, multiple_of=2) == [[0, 1], [2, 3], [4, 5]]
    assert batches.minibatches(mbs, 1, multiple_of=3) == [mbs]
    with pytest.raises(ValueError, match="multiple_of=4"):
        batches.minibatches(mbs, 2, multiple_of=4)


def _group(gid, rewards, extras=False):
    from areal_mega.dataplane import Trajectory

    out = []
    for i, r in enumerate(rewards):
        kw = {"token_extras": {"routed_experts": np.full((6, 2, 2), i, np.int16)}} if extras else {}
        out.append(
            Trajectory.from_tokens(
                [1, 2, 3],
                [4 + i, 5, 6],
                [-0.5, -0.25, -0.125],
                [0, 0, 0],
                reward=r,
                sample_id=f"{gid}-{i}",
                group_id=gid,
                **kw,
            )
        )
    return out


def test_a_step_the_dynamic_filter_empties_plans_padding_only_micro_batches():
    from areal_mega.config import load_config

    cfg = load_config(None, ["algorithm.preset=dapo"])
    trajs = _group("a", [0.0, 0.0]) + _group("b", [1.0, 1.0])  # every group uniform
    plan = batches.plan_step(trajs, cfg, dp_size=2, tp_size=4, pp_size=1, cp_size=1)
    assert plan.sample_ids == [] and plan.stats["n_samples"] == 0
    assert plan.stats["filter/uniform_groups"] == 2
    for [mb] in plan.micro_batches:
        assert mb.n_tokens == 4 and mb.advantages.tolist() == [0.0] * 4
        assert int(mb.loss_mask.sum()) == 0 and mb.labels.tolist() == [-1] * 4


def test_a_dp_rank_without_samples_gets_every_field_of_the_step_as_padding():
    from areal_mega.config import load_config

    cfg = load_config(None, [])
    plan = batches.plan_step(
        _group("a", [0.0, 1.0], extras=True)[:1], cfg, dp_size=2, tp_size=1, pp_size=1, cp_size=1
    )
    (full,), (empty,) = plan.micro_batches
    assert full.routed_experts is not None and empty.routed_experts is not None
    assert tuple(empty.routed_experts.shape[1:]) == tuple(full.routed_experts.shape[1:])
    assert (empty.routed_experts == -1).all() and empty.advantages.dtype == torch.float32
    assert empty.cu_seqlens.tolist() == [0] and int(empty.loss_mask.sum()) == 0

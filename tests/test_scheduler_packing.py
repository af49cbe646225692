"""pack_sequences: layout, padding, per-token / per-sequence fields, CP zigzag shards."""

import numpy as np
import pytest
import torch

from areal_mega.dataplane import Trajectory
from areal_mega.scheduler.packing import PackingError, pack_sequences, zigzag_cp_shard


def traj(i, n_prompt, n_gen, reward=0.5, **kw):
    rng = np.random.default_rng(i)
    return Trajectory.from_tokens(
        rng.integers(1, 100, n_prompt),
        rng.integers(1, 100, n_gen),
        -rng.random(n_gen),
        np.full(n_gen, i),
        reward=reward,
        sample_id=f"s{i}",
        group_id=f"g{i // 2}",
        **kw,
    )


def test_pack_layout_and_trailing_padding():
    ts = [traj(0, 2, 3), traj(1, 4, 1, finish_reason="length"), traj(2, 1, 1)]
    p = pack_sequences(ts, pad_to_multiple=8)
    assert p["input_ids"].dtype == torch.int64 and p["input_ids"].shape == (16,)
    assert p["cu_seqlens"].dtype == torch.int32
    assert p["cu_seqlens"].tolist() == [0, 5, 10, 12]
    assert p["cu_seqlens_padded"].tolist() == [0, 5, 10, 12]
    assert p["max_seqlen"] == 5
    assert p["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]
    assert p["segment_ids"].tolist() == [0] * 5 + [1] * 5 + [2] * 2 + [3] * 4
    for i, t in enumerate(ts):
        lo, hi = p["cu_seqlens"][i].item(), p["cu_seqlens"][i + 1].item()
        assert p["input_ids"][lo:hi].tolist() == t.input_ids.tolist()
        assert p["loss_mask"][lo:hi].numpy().tobytes() == t.loss_mask.tobytes()
        assert p["logprobs"][lo:hi].numpy().tobytes() == t.logprobs.tobytes()
        assert p["versions"][lo:hi].numpy().tobytes() == t.versions.tobytes()
    # padding tokens: id 0, loss_mask 0, logprobs 0, versions -1
    assert p["input_ids"][12:].tolist() == [0] * 4
    assert p["loss_mask"][12:].tolist() == [0] * 4 and p["versions"][12:].tolist() == [-1] * 4
    assert p["rewards"].dtype == torch.float32 and p["rewards"].tolist() == [0.5] * 3
    assert p["seqlens"].tolist() == [5, 5, 2] and p["prompt_lens"].tolist() == [2, 4, 1]
    assert p["finish_codes"].tolist() == [0, 1, 0] and p["min_versions"].tolist() == [0, 1, 2]
    assert p["sample_ids"] == ["s0", "s1", "s2"] and p["group_ids"] == ["g0", "g0", "g1"]
    assert "token_rewards" not in p


def test_no_padding_when_already_a_multiple_and_empty_batch():
    p = pack_sequences([traj(0, 2, 2)], pad_to_multiple=4)
    assert p["input_ids"].shape == (4,) and p["segment_ids"].tolist() == [0] * 4
    e = pack_sequences([], pad_to_multiple=4)
    assert e["input_ids"].shape == (4,) and e["cu_seqlens"].tolist() == [0]
    assert e["loss_mask"].sum().item() == 0 and e["max_seqlen"] == 0
    assert e["rewards"].shape == (0,)
    like = {
        "input_ids": np.arange(3),
        "labels": np.arange(1, 4),
        "advantages": np.ones(3, np.float32),
        "routed_experts": np.zeros((3, 2, 4), np.int16),
    }
    e = pack_sequences([], pad_to_multiple=4, like=like)  # the step's fields, as padding
    assert e["advantages"].tolist() == [0.0] * 4 and e["advantages"].dtype == torch.float32
    assert tuple(e["routed_experts"].shape) == (4, 2, 4) and (e["routed_experts"] == -1).all()
    assert e["labels"].tolist() == [-1] * 4 and e["loss_mask"].sum().item() == 0
    assert {"advantages", "routed_experts", "labels"} <= set(e["token_keys"])


def test_extras_and_per_token_rewards():
    a = traj(0, 2, 2, token_extras={"values": np.arange(4, dtype=np.float32)})
    b = traj(1, 1, 2, reward=2.0, token_extras={"values": np.ones(3, np.float32)})
    a.reward = np.array([0, 0, 1, 2], np.float32)
    p = pack_sequences([a, b], pad_to_multiple=8)
    assert p["values"].tolist() == [0, 1, 2, 3, 1, 1, 1, 0]
    assert p["token_rewards"].tolist() == [0, 0, 1, 2, 0, 0, 2, 0]  # scalar on last token
    assert p["rewards"].tolist() == [3.0, 2.0]
    assert "values" in p["token_keys"] and "token_rewards" in p["token_keys"]


def test_dict_inputs_with_defaults_and_scalar_extras():
    p = pack_sequences(
        [
            {"input_ids": [5, 6, 7], "prompt_len": 1, "adv_scale": 2.0},
            {"input_ids": torch.tensor([8, 9]), "adv_scale": 3.0},
        ]
    )
    assert p["loss_mask"].tolist() == [0, 1, 1, 1, 1]
    assert p["versions"].tolist() == [-1] * 5 and p["adv_scale"].tolist() == [2.0, 3.0]


@pytest.mark.parametrize(
    "items, words",
    [
        (
            [{"input_ids": [1, 2], "values": [1.0, 2.0]}, {"input_ids": [1]}],
            ["sequence 1", "values"],
        ),
        ([{"input_ids": [1, 2], "loss_mask": [1]}], ["sequence 0", "loss_mask", "(2,)"]),
        ([{"input_ids": [1, 2]}, {"loss_mask": [1]}], ["sequence 1", "input_ids"]),
        ([{"input_ids": [1.5]}], ["sequence 0", "input_ids"]),
        ([{"input_ids": [1, 2], "reward": [1, 2, 3]}], ["sequence 0", "reward"]),
        ([{"input_ids": [1, 2], "prompt_len": 5}], ["sequence 0", "prompt_len"]),
    ],
)
def test_errors_name_sequence_and_field(items, words):
    with pytest.raises(PackingError) as e:
        pack_sequences(items)
    for w in words:
        assert w in str(e.value)


def test_cp_padding_and_zigzag_shards_cover_every_token_once():
    ts = [traj(0, 3, 4), traj(1, 2, 1), traj(2, 5, 6)]
    cp = 2
    with pytest.raises(PackingError, match="2\\*cp_size"):
        pack_sequences(ts, pad_to_multiple=2, cp_size=cp)
    p = pack_sequences(ts, pad_to_multiple=8, cp_size=cp)
    assert p["cu_seqlens"].tolist() == [0, 7, 10, 21]
    assert p["cu_seqlens_padded"].tolist() == [0, 8, 12, 24]
    assert p["input_ids"].shape == (24,) and p["max_seqlen_padded"] == 12
    # slot padding continues positions and stays in its segment
    assert p["position_ids"][:8].tolist() == list(range(8))
    assert p["segment_ids"][7].item() == 0 and p["loss_mask"][7].item() == 0
    shards = [zigzag_cp_shard(p, r, cp) for r in range(cp)]
    assert all(s["input_ids"].shape == (12,) for s in shards)
    # rank 0 holds chunks 0 and 3 of seq 0 (chunk size 2): positions 0,1,6,7
    assert shards[0]["position_ids"][:4].tolist() == [0, 1, 6, 7]
    assert shards[1]["position_ids"][:4].tolist() == [2, 3, 4, 5]

    def key(s):
        return sorted(zip(s["segment_ids"].tolist(), s["position_ids"].tolist()))

    union = sorted(key(shards[0]) + key(shards[1]))
    assert union == key(p)
    assert shards[0]["rewards"] is p["rewards"]

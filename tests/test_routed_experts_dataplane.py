"""MoE routes (``token_extras.routed_experts``) on the data plane: the layout read from HF
configs, the per-sample route table, Trajectory.validate, the wire and the journal (bit-exact
round trips), the buffer's checkpoint file, and the trainer intake's arrival check (a bad
sample refused by name, the next good one accepted)."""

import logging

import numpy as np
import pytest

from areal_mega.common.moe_routes import (
    NO_ROUTE,
    ROUTED_EXPERTS,
    RouteLayout,
    RouteTable,
    check_routes,
    decode_sglang_routes,
    encode_sglang_routes,
)
from areal_mega.dataplane import Trajectory
from areal_mega.dataplane.buffer import TrajectoryBuffer
from areal_mega.dataplane.journal import TrajectoryJournal
from areal_mega.dataplane.trajectory import TrajectoryError
from areal_mega.dataplane.transport import TrajectorySender
from areal_mega.dataplane.wire import decode_trajectory, encode_trajectory
from areal_mega.train.intake import TrajectoryIntake
from areal_mega.workflow.tokens import TokenSeq

pytestmark = pytest.mark.timeout(120)

LAYOUT = RouteLayout(num_hidden_layers=3, moe_layers=(0, 1, 2), topk=2, num_experts=8)


def routed_traj(
    sid: str,
    n_prompt: int = 4,
    n_gen: int = 5,
    layers: int = 3,
    topk: int = 2,
    dtype=np.int16,
    seed: int = 0,
) -> Trajectory:
    rng = np.random.default_rng(seed)
    n = n_prompt + n_gen
    routes = rng.integers(0, 8, (n, layers, topk)).astype(dtype)
    routes[-1] = NO_ROUTE
    return Trajectory.from_tokens(
        rng.integers(0, 100, n_prompt),
        rng.integers(0, 100, n_gen),
        -rng.random(n_gen),
        np.zeros(n_gen),
        reward=1.0,
        sample_id=sid,
        group_id=sid,
        created_at=1.0,
        token_extras={ROUTED_EXPERTS: routes, "ref_logprobs": -rng.random(n).astype(np.float32)},
    )


# ---------------------------------------------------------------------- layout, table, codec
def test_layout_from_hf_configs():
    qwen = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 6,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
    }
    lay = RouteLayout.from_hf_config(qwen)
    assert lay.moe_layers == (1, 3, 5) and lay.topk == 8 and lay.dtype == np.int16
    mixtral = {"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert RouteLayout.from_hf_config(mixtral).moe_layers == (0, 1, 2, 3)
    assert RouteLayout.from_hf_config({"num_hidden_layers": 4}) is None  # dense
    assert RouteLayout(2, (0, 1), 2, 40_000).dtype == np.int32
    # the recipe's size: int16 x 48 MoE layers x top-8 = 768 B per token
    q30 = RouteLayout.from_hf_config(
        {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8}
    )
    assert q30.n_moe_layers * q30.topk * q30.dtype.itemsize == 768


def test_sglang_codec_selects_moe_layers_and_checks_size():
    lay = RouteLayout(num_hidden_layers=3, moe_layers=(1, 2), topk=2, num_experts=8)
    rows = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2) % 8
    enc = encode_sglang_routes(rows)
    # what SGLang's own client does with the string
    assert np.array_equal(
        np.frombuffer(__import__("base64").b64decode(enc), np.int32), rows.reshape(-1)
    )
    got = decode_sglang_routes(enc, lay, 4)
    assert got.dtype == np.int16 and np.array_equal(got, rows[:, 1:])
    assert np.array_equal(decode_sglang_routes(enc, lay), got)
    with pytest.raises(ValueError, match="expected 5 tokens x 3 layers x top-2"):
        decode_sglang_routes(enc, lay, 5)
    with pytest.raises(ValueError, match="whole tokens"):
        decode_sglang_routes(encode_sglang_routes(rows.reshape(-1)[:-1]), lay)


def test_route_table_keeps_the_last_forward():
    """A resumed call re-forwards the earlier tokens under the weights that generate the rest:
    its routes replace the first call's (replaying them reproduces the server's latest
    forward)."""
    t = RouteTable(LAYOUT)
    assert t.full(2).tolist() == np.full((2, 3, 2), -1).tolist()
    a = np.full((3, 3, 2), 1, np.int16)
    b = np.full((6, 3, 2), 2, np.int16)  # a resumed call re-forwards positions 0..2
    t.add(a)
    t.add(None)  # a call that forwarded nothing
    t.add(b)
    t.add(np.full((2, 3, 2), 4, np.int16), start=5)  # positions 5, 6 (a partial answer)
    assert t.n_routed == 7
    with pytest.raises(ValueError, match="from position 9, only 7 known"):
        t.add(np.full((1, 3, 2), 5, np.int16), start=9)
    assert t.rows()[:, 0, 0].tolist() == [2, 2, 2, 2, 2, 4, 4]
    t.add(np.full((3, 3, 2), 3, np.int16), start=1)  # inside what is known
    assert t.rows()[:, 0, 0].tolist() == [2, 3, 3, 3, 2, 4, 4]
    full = t.full(9)
    assert full[:7, 0, 0].tolist() == [2, 3, 3, 3, 2, 4, 4] and (full[7:] == NO_ROUTE).all()


def test_token_seq_multi_turn_routes():
    """Turn 2's prefill re-forwards the context: its rows replace turn 1's (the tokens turn 2
    generates saw that forward); the last token -1."""
    seq = TokenSeq()
    seq.add_context([1, 2, 3])
    seq.add_generated([4, 5], [-0.1, -0.2], [0, 0], np.full((4, 3, 2), 1, np.int16))
    seq.add_context([6, 7])
    seq.add_generated([8, 9], [-0.1, -0.2], [1, 1], np.full((8, 3, 2), 2, np.int16))
    tr = seq.to_trajectory(
        reward=0.0, sample_id="s", group_id="g", prompt_len=3, finish_reason="stop"
    ).validate()
    r = tr.token_extras[ROUTED_EXPERTS]
    assert r.shape == (9, 3, 2) and r.dtype == np.int16
    assert r[:, 0, 0].tolist() == [2, 2, 2, 2, 2, 2, 2, 2, -1]
    plain = TokenSeq()
    plain.add_context([1])
    plain.add_generated([2], [-0.1], [0])
    assert (
        ROUTED_EXPERTS
        not in plain.to_trajectory(
            reward=0.0, sample_id="p", group_id="g", prompt_len=1, finish_reason="stop"
        ).token_extras
    )


# ---------------------------------------------------------------------- validate
@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda r: r.astype(np.float32), "integer dtype"),
        (lambda r: r[:-1], r"shape \(8, 3, 2\), expected \(9, layers, topk\)"),
        (lambda r: r[:, :, 0], r"shape \(9, 3\)"),
        (lambda r: np.where(r == NO_ROUTE, -2, r).astype(r.dtype), "expert id -2 < -1"),
    ],
)
def test_validate_refuses_bad_routes(bad, match):
    t = routed_traj("bad")
    t.token_extras[ROUTED_EXPERTS] = bad(t.token_extras[ROUTED_EXPERTS])
    with pytest.raises(TrajectoryError, match=match) as e:
        t.validate()
    assert e.value.field == "token_extras.routed_experts" and e.value.sample_id == "bad"


def test_only_routed_experts_may_be_multi_dimensional():
    t = routed_traj("x")
    t.token_extras["values"] = np.zeros((t.length, 2), np.float32)
    with pytest.raises(TrajectoryError, match=r"token_extras.values.*expected \(9,\)"):
        t.validate()


# ---------------------------------------------------------------------- wire, journal, buffer
@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_wire_round_trip_is_bit_exact_and_zero_copy(dtype):
    t = routed_traj("w", n_prompt=40, n_gen=300, dtype=dtype).validate()
    frames = encode_trajectory(t, pack_threshold=1024)
    back = decode_trajectory([bytes(f) for f in frames])
    r = back.token_extras[ROUTED_EXPERTS]
    assert back.equals(t) and r.shape == (340, 3, 2) and r.dtype == dtype
    assert not r.flags.owndata  # a view on its frame, not a copy
    assert np.shares_memory(back.token_extras[ROUTED_EXPERTS], r)


def test_journal_and_buffer_file_round_trip(tmp_path):
    trajs = [routed_traj(f"j{i}", seed=i).validate() for i in range(3)]
    j = TrajectoryJournal(tmp_path / "journal")
    j.append(trajs)
    j.close()
    back = list(TrajectoryJournal.replay(tmp_path / "journal"))
    assert len(back) == 3 and all(a.equals(b) for a, b in zip(trajs, back))
    buf = TrajectoryBuffer(1)
    buf.put_many(trajs)
    buf.save(str(tmp_path / "buf.bin"))
    loaded = TrajectoryBuffer.load(str(tmp_path / "buf.bin")).pending()
    by_id = {t.sample_id: t for t in loaded}
    assert all(by_id[t.sample_id].equals(t) for t in trajs)


# ---------------------------------------------------------------------- the intake's check
def test_check_routes_names_sample_and_shapes():
    assert check_routes(routed_traj("ok"), LAYOUT) is None
    msg = check_routes(routed_traj("s1", layers=2), LAYOUT)
    assert "token_extras.routed_experts" in msg and "'s1'" in msg
    assert "shape (9, 2, 2), expected (9, 3, 2)" in msg
    t = routed_traj("s2")
    t.token_extras[ROUTED_EXPERTS][0, 0, 0] = 8
    assert "expected [-1, 8)" in check_routes(t, LAYOUT)


def test_intake_refuses_bad_routes_and_accepts_the_next(tmp_path, caplog):
    intake = TrajectoryIntake(
        f"ipc://{tmp_path}/t.sock", tmp_path, group_size=1, route_layout=LAYOUT
    ).start()
    try:
        with caplog.at_level(logging.WARNING), TrajectorySender(intake.receiver.endpoint) as s:
            s.send(routed_traj("wrong-layers", layers=4))
            s.send(routed_traj("wrong-topk", topk=3))
            s.send(routed_traj("good"))
            s.flush(30)
            assert intake.buffer.wait_for(1, timeout=30)
        got = intake.next_groups(1, timeout=10)
        assert [t.sample_id for t in got] == ["good"]
        assert intake.receiver.rejected["invalid_field"] == 2
        assert intake.n_accepted == 1
        assert any(
            "token_extras.routed_experts of sample 'wrong-layers': shape (9, 4, 2), "
            "expected (9, 3, 2)" in r.getMessage()
            for r in caplog.records
        )
        assert intake.stats()["dataplane/rejected_total"] == 2.0
    finally:
        intake.close()
    # the refused samples were never journaled
    assert [t.sample_id for t in TrajectoryJournal.replay(tmp_path / "journal")] == ["good"]

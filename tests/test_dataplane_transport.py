"""Real ZMQ sockets (ipc and loopback tcp), real sender processes, hostile input."""

import multiprocessing as mp
import os

import msgpack
import numpy as np
import pytest
import zmq

from areal_mega.dataplane import (
    DataplaneError,
    Trajectory,
    TrajectoryReceiver,
    TrajectorySender,
    WireError,
    check_endpoint,
    decode_trajectory,
    encode_trajectory,
)
from tests.helpers.trajectories import make_traj

N_SENDERS, PER_SENDER = 3, 40


def _sender_main(endpoint, secret, sender, n):
    with TrajectorySender(endpoint, secret=secret) as s:
        for i in range(n):
            s.send(make_traj(sender, i), timeout=60)


@pytest.mark.parametrize("transport, secret", [("ipc", None), ("tcp", "s3cret")])
def test_many_sender_processes_exactly_once_bit_identical(tmp_path, transport, secret):
    ep = f"ipc://{tmp_path}/dp.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
    with TrajectoryReceiver(ep, secret=secret, max_queue=8) as rx:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_sender_main, args=(rx.endpoint, secret, w, PER_SENDER))
            for w in range(N_SENDERS)
        ]
        for p in procs:
            p.start()
        got = {}
        try:
            while len(got) < N_SENDERS * PER_SENDER:
                t = rx.recv(timeout=60)
                assert t is not None, f"only {len(got)} trajectories arrived"
                assert t.sample_id not in got, f"{t.sample_id} arrived twice"
                got[t.sample_id] = t
            assert rx.recv(timeout=0.3) is None  # nothing extra (no duplicates)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        assert [p.exitcode for p in procs] == [0] * N_SENDERS
        for w in range(N_SENDERS):
            for i in range(PER_SENDER):
                assert got[f"w{w}-{i}"].equals(make_traj(w, i)), f"w{w}-{i} differs"
        assert rx.accepted == N_SENDERS * PER_SENDER and not rx.rejected


def _frames(t, secret=None):
    return [bytes(memoryview(f)) for f in encode_trajectory(t, secret)]


def _garbage(secret):
    """(expected reason or set of reasons, frames) pairs covering every check.

    With a secret, every malformed message is signed with it (a sender that holds the secret
    but is buggy), so each reaches the check under test; unsigned, wrongly signed and
    tampered messages are added for the HMAC checks."""
    rng = np.random.default_rng(0)
    good = make_traj(9, 1)
    out = []
    for _k in range(20):
        out.append(({"bad_header", "schema"}, [rng.bytes(int(rng.integers(1, 200)))]))
    for _k in range(5):  # random multi-frame junk
        out.append(({"bad_header", "schema"}, [rng.bytes(50) for _ in range(4)]))
    out.append(("bad_header", [msgpack.packb([1, 2, 3])]))
    fr = _frames(good)
    out.append(("frame_count", fr[:1]))  # truncated multipart
    out.append(("frame_count", fr + [b"extra"]))
    h = msgpack.unpackb(fr[0])

    def with_header(mutate, frames=None, header=h):
        hh = msgpack.unpackb(msgpack.packb(header))
        mutate(hh)
        return [msgpack.packb(hh, use_bin_type=True)] + (frames or fr)[1:]

    out.append(("schema", with_header(lambda hh: hh.update(schema=99))))
    out.append(("bad_header", with_header(lambda hh: hh["fields"][0].pop())))
    out.append(("bad_header", with_header(lambda hh: hh["fields"][0].__setitem__(3, 1))))
    out.append(("bad_dtype", with_header(lambda hh: hh["fields"][0].__setitem__(1, "|O"))))
    out.append(("bad_dtype", with_header(lambda hh: hh["fields"][0].__setitem__(1, "<f4"))))
    out.append(("bad_shape", with_header(lambda hh: hh["fields"][1].__setitem__(2, [-3]))))
    out.append(("bad_shape", with_header(lambda hh: hh["fields"][1].__setitem__(2, "x"))))
    out.append(
        (
            "frame_size",
            with_header(lambda hh: hh["fields"][0].__setitem__(2, [hh["fields"][0][2][0] + 2])),
        )
    )  # runs past the end of the pack
    out.append(("frame_size", with_header(lambda hh: None, [fr[0], fr[1][:-4]] + fr[2:])))
    out.append(("frame_size", with_header(lambda hh: None, [fr[0], fr[1] + bytes(8)] + fr[2:])))
    out.append(("frame_count", with_header(lambda hh: hh["fields"][2].__setitem__(3, False))))
    out.append(("invalid_field", with_header(lambda hh: hh["meta"].update(finish_reason="eos"))))
    out.append(("frame_size", with_header(lambda hh: hh["fields"].pop())))  # bytes left over
    out.append(("invalid_field", with_header(lambda hh: hh["fields"][4].__setitem__(0, "bonus"))))
    out.append(("bad_header", with_header(lambda hh: hh["meta"].update(color="red"))))
    n_big = 17_000  # 68 KB fields get frames of their own
    big = _frames(Trajectory.from_tokens(np.arange(n_big), [1], [0.0], [0], sample_id="big"))
    hb = msgpack.unpackb(big[0])
    own = [i for i, f in enumerate(hb["fields"]) if not f[3]]
    assert own, "expected fields too large for the pack"
    out.append(
        (
            "frame_size",
            with_header(
                lambda hh: hh["fields"][own[0]].__setitem__(2, [hh["fields"][own[0]][2][0] - 1]),
                big,
                hb,
            ),
        )
    )  # own frame longer than its shape
    out.append(("frame_count", with_header(lambda hh: None, big[:-1], hb)))
    if secret is not None:
        from areal_mega.dataplane.wire import _mac, secret_bytes

        key = secret_bytes(secret)
        out = [(reason, [f[0] + _mac(key, f[0], f[1:])] + f[1:]) for reason, f in out]
        out.append(("missing_hmac", fr))  # the sender has no secret
        out.append(("bad_hmac", _frames(good, "wrong-secret")))
        signed = _frames(good, secret)
        tampered = list(signed)
        tampered[1] = bytes([tampered[1][0] ^ 1]) + tampered[1][1:]
        out.append(("bad_hmac", tampered))
        out.append(("bad_hmac", [signed[0][:-1] + bytes([signed[0][-1] ^ 1])] + signed[1:]))
        out.append(("missing_hmac", [b"short"]))
    out.append(("oversize", [fr[0]] + [b"x" * 100_000] * 5))
    return out


@pytest.mark.parametrize("secret", [None, "k3y"])
def test_garbage_flood_keeps_accepting_good_messages(secret):
    with TrajectoryReceiver("tcp://127.0.0.1:*", secret=secret, max_message_bytes=400_000) as rx:
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)  # a peer that ignores the protocol and sends junk
        raw.connect(rx.endpoint)
        garbage = _garbage(secret)
        with TrajectorySender(rx.endpoint, secret=secret) as tx:
            for k, (_, frames) in enumerate(garbage):
                raw.send_multipart(frames)
                tx.send(make_traj(5, k))
            got = []
            while len(got) < len(garbage):
                t = rx.recv(timeout=30)
                assert t is not None, f"receiver stopped after {len(got)} good messages"
                got.append(t)
            assert rx.recv(timeout=0.5) is None
        raw.close(0)
        assert sorted(t.sample_id for t in got) == sorted(f"w5-{k}" for k in range(len(garbage)))
        assert all(t.equals(make_traj(5, int(t.sample_id.split("-")[1]))) for t in got)
        expected = {}
        for reason, _ in garbage:
            if isinstance(reason, str):
                expected[reason] = expected.get(reason, 0) + 1
        for reason, n in expected.items():
            assert rx.rejected[reason] >= n, (reason, dict(rx.rejected))
        assert sum(rx.rejected.values()) == len(garbage)
        assert rx.accepted == len(garbage)


def test_backpressure_blocks_senders_then_recovers():
    with TrajectoryReceiver("tcp://127.0.0.1:*", max_queue=4) as rx:
        with TrajectorySender(rx.endpoint, window=4) as tx:
            sent = 0
            with pytest.raises(TimeoutError, match="unacknowledged"):
                for i in range(50):
                    tx.send(make_traj(1, i), timeout=0.3)
                    sent += 1
            assert sent == 4 and tx.in_flight == 4  # a slow trainer stops the sender
            for i in range(4):
                assert rx.recv(timeout=5).sample_id == f"w1-{i}"
            tx.send(make_traj(1, 99), timeout=5)  # acks reopened the window
            assert rx.recv(timeout=5).sample_id == "w1-99"
            assert rx.recv(timeout=0) is None  # queue empty -> remaining acks flushed
            assert tx.flush(timeout=5) and tx.in_flight == 0


def test_sender_close_waits_until_everything_was_taken(tmp_path):
    """The scenario where plain PUSH/PULL lost messages: exit while the receiver lags."""
    with TrajectoryReceiver(f"ipc://{tmp_path}/c.sock", max_queue=2) as rx:
        tx = TrajectorySender(rx.endpoint, window=8)
        for i in range(8):
            tx.send(make_traj(2, i))
        import threading

        left = []
        th = threading.Thread(target=lambda: left.append(tx.close(linger_s=30)))
        th.start()
        got = [rx.recv(timeout=10) for _ in range(8)]
        th.join(30)
        assert left == [0]
        assert [t.sample_id for t in got] == [f"w2-{i}" for i in range(8)]


def test_endpoint_checks(tmp_path):
    with pytest.raises(DataplaneError, match="not loopback"):
        check_endpoint("tcp://0.0.0.0:5555", bind=True)
    with pytest.raises(DataplaneError, match="not loopback"):
        check_endpoint("tcp://*:5555", bind=True)
    assert check_endpoint("tcp://0.0.0.0:5555", bind=True, allow_remote=True)
    assert check_endpoint("tcp://localhost:0", bind=True) == "tcp://127.0.0.1:*"
    with pytest.raises(DataplaneError, match="longer than"):
        check_endpoint("ipc://" + "x" * 200)
    with pytest.raises(DataplaneError, match="scheme"):
        check_endpoint("udp://127.0.0.1:5")
    with pytest.raises(DataplaneError, match="port"):
        check_endpoint("tcp://127.0.0.1:99999")
    path = f"{tmp_path}/stale.sock"
    open(path, "w").close()  # a stale socket file from a crashed run is replaced
    with TrajectoryReceiver(f"ipc://{path}") as rx:
        assert rx.endpoint == f"ipc://{path}"
    assert not os.path.exists(path)


def _acks(sock, timeout_ms=2000):
    """Ack counts a DEALER has received, until none arrives for ``timeout_ms``."""
    out = []
    while sock.poll(timeout_ms if not out else 200):
        out.append(int.from_bytes(sock.recv(), "little"))
    return out


@pytest.mark.parametrize("advertise", [True, False])
def test_acks_are_batched_per_advertised_window_and_flushed_when_idle(advertise):
    """A TrajectorySender advertises its window in its routing id: the receiver acks it per
    window // 4 messages (and the rest as soon as nothing else is queued); any other peer is
    acked per message. inproc delivers synchronously, so all 20 are queued before recv."""
    from areal_mega.dataplane.transport import _sender_routing_id

    ctx = zmq.Context()
    with TrajectoryReceiver("inproc://acks", context=ctx) as rx:
        peer = ctx.socket(zmq.DEALER)
        if advertise:
            peer.setsockopt(zmq.ROUTING_ID, _sender_routing_id(64))
        peer.connect(rx.endpoint)
        for i in range(20):
            peer.send_multipart(encode_trajectory(make_traj(3, i)), copy=False)
        got = [rx.recv(timeout=5) for _ in range(20)]
        assert [t.sample_id for t in got] == [f"w3-{i}" for i in range(20)]
        assert _acks(peer) == ([16, 4] if advertise else [1] * 20)
        peer.close(0)
    ctx.term()


def test_last_message_is_acked_by_the_recv_that_takes_it():
    """Batched acks keep close loss-free and prompt: a trainer that takes the last message and
    then stops calling recv does not leave the sender waiting."""
    with TrajectoryReceiver("tcp://127.0.0.1:*") as rx:
        with TrajectorySender(rx.endpoint, window=64) as tx:
            for i in range(7):  # fewer than one ack batch (16)
                tx.send(make_traj(4, i))
            got = []
            while len(got) < 7:
                got.append(rx.recv(timeout=10))
            assert tx.flush(timeout=10) and tx.in_flight == 0
            assert tx.close(linger_s=5) == 0
        assert [t.sample_id for t in got] == [f"w4-{i}" for i in range(7)]


@pytest.mark.parametrize("secret", [None, "k3y"])
def test_decoder_names_the_reason_of_every_malformed_message(secret):
    """decode_trajectory on each message of _garbage: its expected reason and a detail; good
    messages (extras, 2-D and 0-d shapes, fields in frames of their own) decode bit-exactly."""
    rng = np.random.default_rng(3)
    good = [make_traj(2, i) for i in range(6)]
    good.append(
        Trajectory.from_tokens(
            np.arange(17_000),
            [1],
            [0.0],
            [0],
            sample_id="big",
            token_extras={"grid": rng.random((17_001, 2), np.float32)},
        )
    )
    for t in good:  # validate=False: a 2-D extra is the wire's to carry, not a trajectory's
        got = decode_trajectory(
            _frames(t, secret), secret, max_message_bytes=400_000, validate=False
        ).arrays()
        want = t.arrays()
        assert got.keys() == want.keys()
        for k, a in want.items():
            assert (
                got[k].dtype.str == a.dtype.newbyteorder("<").str
                and got[k].shape == a.shape
                and got[k].tobytes() == a.tobytes()
            ), k
    for reason, frames in _garbage(secret):
        with pytest.raises(WireError) as e:
            decode_trajectory(frames, secret, max_message_bytes=400_000)
        assert e.value.reason in ({reason} if type(reason) is str else reason), e.value
        assert e.value.detail


def test_encoder_frames_for_big_strided_and_byte_swapped_fields():
    """Fields of 64 KiB or more get frames of their own, the rest share the pack; strided and
    big-endian arrays travel as C-contiguous little-endian bytes and decode equal."""
    n = 17_000
    big = Trajectory.from_tokens(
        np.arange(n),
        [1],
        [0.0],
        [0],
        sample_id="big",
        token_extras={"v": np.arange(n + 1, dtype=np.int64)},
    )
    strided = make_traj(4, 0)
    strided.token_extras["s"] = np.repeat(strided.logprobs, 2)[::2]
    swapped = make_traj(4, 1)
    swapped.token_extras["b"] = swapped.versions.astype(">i4")
    for t in (big, strided):
        for secret in (None, "k"):
            frames = [bytes(memoryview(f).cast("B")) for f in encode_trajectory(t, secret)]
            assert decode_trajectory(frames, secret).equals(t)
    assert len(encode_trajectory(big)) == 2 + 4  # header, pack; ids, logprobs, versions, v
    assert len(encode_trajectory(strided)) == 2
    got = decode_trajectory(encode_trajectory(swapped)).token_extras["b"]
    assert got.dtype.str == "<i4" and np.array_equal(got, swapped.versions)

"""Throughput of TrajectorySender/TrajectoryReceiver vs raw pyzmq PUSH/PULL zero-copy.

One run prints, for trajectories of 1k, 8k and 32k tokens on ipc and loopback tcp,
trajectories/s and GB/s of ours and of raw pyzmq, and their ratio (goal: ours >= 80 % of raw).
The sender runs in a separate process (started before timing); the receiver is timed in this
one, from the first message taken to the last. Same transport, same trajectories, same queue
bounds (64 messages):

* **raw** (the baseline): what one writes with bare pyzmq to ship a trajectory zero-copy, minus
  everything ours adds. Sender: PUSH (SNDHWM 64); frames encoded once before the loop: a
  msgpack header (sample id, per-field name/dtype/shape, metadata) and one frame per tensor,
  ``send(..., copy=False)`` each (pyzmq's default copy threshold: frames < 64 KiB are copied).
  Receiver: PULL (RCVHWM 64), ``recv(copy=False)`` of every frame, ``np.frombuffer`` (uint8)
  per frame; no header parsing, no checks, no acks.
* **ours**: ``TrajectorySender.send(traj)`` per message (encodes the header and pack every
  time, window 64, reads acks) and ``TrajectoryReceiver(max_queue=64).recv()`` (ROUTER, batched
  acks, header msgpack + every wire check, zero-copy arrays with their dtypes, a
  ``Trajectory`` and its full ``validate()``); the result is checked to be non-None.
* **raw, our frames** (printed for transparency): the raw loop moving our exact wire frames
  (header + pack + large fields). ours / this is the cost of our checks, acks and encoding
  alone; ours / raw also includes what the wire format saves (small fields packed into one
  frame).

Also printed: CPU time per message of the receiving process (the timed loop, all its threads:
libzmq's I/O thread too) and of the sending process (its send loop), best of the repetitions:
less sensitive to noise than rates, and on a small shared machine throughput follows the CPU
both processes spend. Every configuration is measured ``--reps`` times, the kinds interleaved
(their order rotating), and the best of each is reported (ratios are of the best rates).

The last column, ``cpu ratio`` = raw (recv + send) CPU / ours (recv + send) CPU per message, is
the throughput ratio to expect when both sides are CPU-bound; it moves far less with the
machine's noise than the rates do.

Usage: python bench/dataplane.py [--secret] [--reps 5] [--mb 150] [--sizes 1024,8192,32768]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_mega.dataplane import (
    Trajectory,
    TrajectoryReceiver,  # noqa: E402
    TrajectorySender,
    encode_trajectory,
)

GOAL = 0.80


def make(n_tokens: int, k: int) -> Trajectory:
    rng = np.random.default_rng(n_tokens)
    n_p = n_tokens // 4
    n_g = n_tokens - n_p
    return Trajectory.from_tokens(
        rng.integers(0, 150_000, n_p),
        rng.integers(0, 150_000, n_g),
        -rng.random(n_g),
        np.full(n_g, 3),
        reward=1.0,
        sample_id=f"s{k}",
        group_id="g",
        created_at=float(k),
    )


def ours_sender(endpoint, n_tokens, count, secret, conn):
    base = make(n_tokens, 0)
    with TrajectorySender(endpoint, secret=secret, window=64) as tx:
        c0 = time.process_time()
        for k in range(count):
            base.sample_id = f"s{k}"
            tx.send(base)
        conn.send(time.process_time() - c0)  # CPU of the whole process (all its threads)


def raw_frames(n_tokens: int) -> list:
    """The bare-pyzmq encoding of a trajectory: msgpack metadata + one frame per tensor."""
    t = make(n_tokens, 0)
    arrays = t.arrays()
    head = {**t.metadata(), "fields": [[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()]}
    return [msgpack.packb(head)] + list(arrays.values())


def raw_sender(endpoint, n_tokens, count, conn, ours_frames):
    frames = encode_trajectory(make(n_tokens, 0)) if ours_frames else raw_frames(n_tokens)
    ctx = zmq.Context(io_threads=1)
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 64)
    s.setsockopt(zmq.LINGER, 30_000)
    s.connect(endpoint)
    c0 = time.process_time()
    send, body, last = s.send, frames[:-1], frames[-1]
    for _ in range(count):  # = send_multipart(frames, copy=False), minus its per-frame checks
        for f in body:
            send(f, zmq.SNDMORE, copy=False)
        send(last, 0, copy=False)
    conn.send(time.process_time() - c0)
    s.close()
    ctx.term()


def run_ours(endpoint, n_tokens, count, secret):
    with TrajectoryReceiver(endpoint, secret=secret, max_queue=64) as rx:
        here, there = mp.Pipe()
        p = mp.get_context("spawn").Process(
            target=ours_sender, args=(rx.endpoint, n_tokens, count, secret, there)
        )
        p.start()
        first = rx.recv(timeout=60)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(count - 1):
            assert rx.recv(timeout=60) is not None
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        nbytes = rx.bytes_accepted / rx.accepted
        tx_cpu = here.recv() if here.poll(60) else float("nan")
        p.join(60)
        assert first is not None and rx.accepted == count and not rx.rejected
        assert p.exitcode == 0
    return _result(count, dt, nbytes, cpu, tx_cpu)


def _result(count, dt, nbytes, rx_cpu, tx_cpu):
    """(traj/s, GB/s, receiver CPU us/msg, sender CPU us/msg), rates over count - 1 messages."""
    return (
        (count - 1) / dt,
        nbytes * (count - 1) / dt / 1e9,
        rx_cpu / (count - 1) * 1e6,
        tx_cpu / count * 1e6,
    )


def run_raw(endpoint, n_tokens, count, ours_frames=False):
    ctx = zmq.Context.instance()
    r = ctx.socket(zmq.PULL)
    r.setsockopt(zmq.RCVHWM, 64)
    r.bind(endpoint)
    ep = r.getsockopt_string(zmq.LAST_ENDPOINT)
    here, there = mp.Pipe()
    p = mp.get_context("spawn").Process(
        target=raw_sender, args=(ep, n_tokens, count, there, ours_frames)
    )
    p.start()
    r.recv_multipart(copy=False)
    nbytes = 0
    t0, c0 = time.perf_counter(), time.process_time()
    recv = r.recv
    for _ in range(count - 1):
        # = recv_multipart(copy=False), minus its getsockopt(RCVMORE) per frame (ours does this)
        f = recv(0, copy=False)
        frames = [f]
        while f.more:
            f = recv(0, copy=False)
            frames.append(f)
        arrays = [np.frombuffer(f, dtype=np.uint8) for f in frames]
        nbytes = sum(a.nbytes for a in arrays)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tx_cpu = here.recv() if here.poll(60) else float("nan")
    p.join(60)
    r.close(0)
    return _result(count, dt, nbytes, cpu, tx_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--secret", action="store_true", help="HMAC every message in ours")
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--transports", default="ipc,tcp")
    ap.add_argument("--mb", type=float, default=150.0, help="MB moved per measurement")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (best kept)")
    args = ap.parse_args()
    secret = "bench-secret" if args.secret else None
    tmp = tempfile.mkdtemp(prefix="dpbench")
    kinds = ("raw", "ours", "raw_ours_frames")
    verdict = []
    print(
        f"{'transport':9} {'tokens':>6} | {'ours traj/s':>11} {'GB/s':>6} | "
        f"{'raw traj/s':>10} {'GB/s':>6} | ratio | raw, our frames: traj/s ratio | "
        f"ours CPU us/msg | raw CPU us/msg | cpu ratio  (secret={'on' if secret else 'off'}"
        f", best of {args.reps})"
    )
    print(
        f"{'':9} {'':>6} | {'':>11} {'':>6} | {'':>10} {'':>6} | {'':5} | {'':>22} {'':5} | "
        f"{'recv':>6} {'send':>6} | {'recv':>6} {'send':>6} |"
    )
    for transport in args.transports.split(","):
        for n in [int(x) for x in args.sizes.split(",")]:
            per = n * 13 + 300
            count = max(200, min(20_000, int(args.mb * 1e6 / per)))

            def ep(tag):
                return f"ipc://{tmp}/{tag}.sock" if transport == "ipc" else "tcp://127.0.0.1:*"  # noqa: B023

            runs = {k: [] for k in kinds}
            for rep in range(args.reps):
                for kind in kinds[rep % 3 :] + kinds[: rep % 3]:
                    runs[kind].append(
                        run_ours(ep(kind), n, count, secret)
                        if kind == "ours"
                        else run_raw(ep(kind), n, count, ours_frames=kind != "raw")
                    )
            best = {k: max(v) for k, v in runs.items()}
            (o_tps, o_gbs, *_), (r_tps, r_gbs, *_) = best["ours"], best["raw"]
            t_tps = best["raw_ours_frames"][0]
            o_cpu = [min(r[i] for r in runs["ours"]) for i in (2, 3)]
            r_cpu = [min(r[i] for r in runs["raw"]) for i in (2, 3)]
            print(
                f"{transport:9} {n:>6} | {o_tps:>11.0f} {o_gbs:>6.2f} | {r_tps:>10.0f} "
                f"{r_gbs:>6.2f} | {o_tps / r_tps:5.2f} | {t_tps:>22.0f} {o_tps / t_tps:5.2f} | "
                f"{o_cpu[0]:6.1f} {o_cpu[1]:6.1f} | {r_cpu[0]:6.1f} {r_cpu[1]:6.1f} | "
                f"{sum(r_cpu) / sum(o_cpu):9.2f}",
                flush=True,
            )
            verdict.append((f"{transport}/{n}", o_tps / r_tps))
    met = [f"{k} {r:.2f}" for k, r in verdict if r >= GOAL]
    missed = [f"{k} {r:.2f}" for k, r in verdict if r < GOAL]
    print(
        f"goal ours >= {GOAL:.2f} x raw traj/s: met at {', '.join(met) or 'none'}; "
        f"missed at {', '.join(missed) or 'none'}"
    )


if __name__ == "__main__":
    main()

"""Throughput of TrajectorySender/TrajectoryReceiver vs raw pyzmq PUSH/PULL zero-copy.

One run prints, for trajectories of 1k, 8k and 32k tokens on ipc and loopback tcp,
trajectories/s and GB/s of both and their ratio (goal: ours >= 80 % of raw). The sender runs
in a separate process; the receiver (timed) in this one. Raw sends the very same frames (our
encoded header + tensor frames) with ``copy=False`` and the receiver wraps each frame in a
numpy array, so the difference is our header/HMAC/validation/ack cost.

Usage: python bench/dataplane.py [--secret] [--seconds 1.5]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_mega.dataplane import (Trajectory, TrajectoryReceiver,  # noqa: E402
                                  TrajectorySender, encode_trajectory)


def make(n_tokens: int, k: int) -> Trajectory:
    rng = np.random.default_rng(n_tokens)
    n_p = n_tokens // 4
    n_g = n_tokens - n_p
    return Trajectory.from_tokens(rng.integers(0, 150_000, n_p), rng.integers(0, 150_000, n_g),
                                  -rng.random(n_g), np.full(n_g, 3), reward=1.0,
                                  sample_id=f"s{k}", group_id="g", created_at=float(k))


def ours_sender(endpoint, n_tokens, count, secret):
    base = make(n_tokens, 0)
    with TrajectorySender(endpoint, secret=secret, window=64) as tx:
        for k in range(count):
            base.sample_id = f"s{k}"
            tx.send(base)


def raw_sender(endpoint, n_tokens, count):
    frames = encode_trajectory(make(n_tokens, 0))
    ctx = zmq.Context(io_threads=1)
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 64)
    s.setsockopt(zmq.LINGER, 30_000)
    s.connect(endpoint)
    for _ in range(count):
        s.send_multipart(frames, copy=False)
    s.close()
    ctx.term()


def run_ours(endpoint, n_tokens, count, secret):
    with TrajectoryReceiver(endpoint, secret=secret, max_queue=64) as rx:
        p = mp.get_context("spawn").Process(target=ours_sender,
                                            args=(rx.endpoint, n_tokens, count, secret))
        p.start()
        first = rx.recv(timeout=60)
        t0 = time.perf_counter()
        for _ in range(count - 1):
            assert rx.recv(timeout=60) is not None
        dt = time.perf_counter() - t0
        nbytes = rx.bytes_accepted / rx.accepted
        p.join(60)
        assert first is not None and rx.accepted == count and not rx.rejected
    return (count - 1) / dt, nbytes * (count - 1) / dt / 1e9


def run_raw(endpoint, n_tokens, count):
    ctx = zmq.Context.instance()
    r = ctx.socket(zmq.PULL)
    r.setsockopt(zmq.RCVHWM, 64)
    r.bind(endpoint)
    ep = r.getsockopt_string(zmq.LAST_ENDPOINT)
    p = mp.get_context("spawn").Process(target=raw_sender, args=(ep, n_tokens, count))
    p.start()
    r.recv_multipart(copy=False)
    nbytes = 0
    t0 = time.perf_counter()
    for _ in range(count - 1):
        frames = r.recv_multipart(copy=False)
        arrays = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]
        nbytes = sum(a.nbytes for a in arrays)
    dt = time.perf_counter() - t0
    p.join(60)
    r.close(0)
    return (count - 1) / dt, nbytes * (count - 1) / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--secret", action="store_true", help="HMAC every message in ours")
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--mb", type=float, default=150.0, help="MB moved per measurement")
    args = ap.parse_args()
    secret = "bench-secret" if args.secret else None
    tmp = tempfile.mkdtemp(prefix="dpbench")
    print(f"{'transport':9} {'tokens':>6} | {'ours traj/s':>11} {'GB/s':>6} | "
          f"{'raw traj/s':>10} {'GB/s':>6} | ratio  (secret={'on' if secret else 'off'})")
    for transport in ("ipc", "tcp"):
        for n in [int(x) for x in args.sizes.split(",")]:
            per = n * 13 + 300
            count = max(200, min(20_000, int(args.mb * 1e6 / per)))
            def ep(tag):
                return f"ipc://{tmp}/{tag}.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
            raw_tps, raw_gbs = run_raw(ep("raw"), n, count)
            our_tps, our_gbs = run_ours(ep("ours"), n, count, secret)
            print(f"{transport:9} {n:>6} | {our_tps:>11.0f} {our_gbs:>6.2f} | {raw_tps:>10.0f} "
                  f"{raw_gbs:>6.2f} | {our_tps / raw_tps:5.2f}", flush=True)


if __name__ == "__main__":
    main()

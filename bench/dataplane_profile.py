"""Where the receiving side of the data plane spends its CPU, per message, in the real flow.

A ``TrajectorySender`` in another process (as in ``bench/dataplane.py``) sends N trajectories;
this process receives them through the ``TrajectoryReceiver``'s socket, step by step, and
charges the main thread's CPU time (``time.thread_time_ns``) of each step: socket recv of the
frames, ack bookkeeping, header msgpack alone, ``np.frombuffer`` of every frame alone, the whole
``decode_trajectory(validate=False)``, ``Trajectory.validate()``, and the release of the frames.
Also printed: the same ``decode``/``validate`` on a hot in-cache message (what a micro-benchmark
sees) and the process CPU (all threads: the libzmq I/O thread too) per message.

With ``--metrics RUN/metrics.jsonl`` (a training run's, e.g. the CPU demo's), also the data
plane's share of a training step: trajectories per step x the receive path's CPU per message
(recv, ack, decode, validate, release) / the median step time. It is what decided that the
data plane needs no native code.

Usage: python bench/dataplane_profile.py [--tokens 32768] [--count 3000] [--tcp]
                                         [--metrics runs/x/rl/metrics.jsonl]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import msgpack
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataplane import make, ours_sender  # noqa: E402

from areal_mega.dataplane import TrajectoryReceiver, decode_trajectory, encode_trajectory  # noqa

STEPS = (
    "recv frames",
    "ack",
    "msgpack header",
    "frombuffer x all",
    "decode(no validate)",
    "validate",
    "release frames",
)


def hot(n_tokens: int, reps: int = 2000) -> tuple[float, float]:
    import zmq

    frames = [
        zmq.Frame(bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f)
        for f in encode_trajectory(make(n_tokens, 0))
    ]
    traj = decode_trajectory(frames)
    out = []
    for fn in (lambda: decode_trajectory(frames, validate=False), traj.validate):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t0) / reps * 1e6)
        out.append(best)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--tcp", action="store_true")
    ap.add_argument("--metrics", default=None, help="a run's metrics.jsonl: print the share")
    args = ap.parse_args()
    n, count, skip = args.tokens, args.count, 10
    ep = "tcp://127.0.0.1:*" if args.tcp else f"ipc://{tempfile.mkdtemp(prefix='dpprof')}/p.sock"
    T = time.thread_time_ns
    acc = np.zeros(len(STEPS), dtype=np.int64)
    with TrajectoryReceiver(ep, max_queue=64) as rx:
        here, there = mp.Pipe()
        p = mp.get_context("spawn").Process(
            target=ours_sender, args=(rx.endpoint, n, count, None, there)
        )
        p.start()
        sock, unacked = rx._sock, rx._unacked
        for i in range(count):
            if i == skip:
                c0 = time.process_time()
            t0 = T()
            part = sock.recv(0, copy=False)
            peer = part.bytes
            frames = []
            while part.more:
                part = sock.recv(0, copy=False)
                frames.append(part)
            t1 = T()
            unacked[peer] = unacked.get(peer, 0) + 1
            if unacked[peer] >= 16:  # the batch a window-64 sender gets
                rx._ack(peer)
            t2 = T()
            msgpack.unpackb(frames[0], raw=False)
            t3 = T()
            [np.frombuffer(f, np.uint8) for f in frames]
            t4 = T()
            traj = decode_trajectory(frames, validate=False)
            t5 = T()
            traj.validate()
            t6 = T()
            del traj, frames, part
            t7 = T()
            if i >= skip:
                acc += (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)
        cpu = time.process_time() - c0
        rx.flush_acks()
        here.recv()
        p.join(60)
    m = acc / (count - skip) / 1e3
    print(f"{n} tokens, {count - skip} messages, main-thread CPU us/msg per step:")
    for k, v in zip(STEPS, m):
        print(f"  {k:22} {v:7.1f}")
    print(
        f"  {'sum':22} {m.sum():7.1f}   (process CPU, all threads: "
        f"{cpu / (count - skip) * 1e6:.1f})"
    )
    d, v = hot(n)
    print(f"hot in-cache: decode(no validate) {d:.1f} us, validate {v:.1f} us")
    if args.metrics:
        path_us = sum(
            m[STEPS.index(k)]
            for k in ("recv frames", "ack", "decode(no validate)", "validate", "release frames")
        )
        step_share(args.metrics, path_us)


def step_share(metrics_path: str, path_us: float) -> None:
    """Print the receive path's share of a training step of the run in ``metrics_path``."""
    rows = [json.loads(x) for x in open(metrics_path) if x.strip()][1:]  # step 1: warm-up
    step_s = statistics.median(r["time/step"] for r in rows)
    per_step = statistics.median(r["n_samples"] for r in rows)
    share = per_step * path_us * 1e-6 / step_s
    print(
        f"{metrics_path}: median step {step_s:.3f} s, {per_step:.0f} trajectories/step "
        f"({per_step / step_s:.0f}/s consumed); receive path {path_us:.1f} us/msg -> "
        f"{per_step * path_us / 1e3:.2f} ms/step = {100 * share:.2f} % of a step; "
        f"one receiver thread could take {1e6 / path_us:.0f} msgs/s"
    )


if __name__ == "__main__":
    main()

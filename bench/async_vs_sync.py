#!/usr/bin/env python
"""Asynchronous (η = 2) vs synchronous (η = 0) RL on the tiny CPU recipe, same number of steps.

    python bench/async_vs_sync.py [--steps 60] [--sft-steps 40] [--etas 0 2]

Both runs start from the same SFT warm-up and run the full system (CPU rollout server, rollout
worker, ZMQ data plane, trainer) through ``launch.local``. With η = 0 generation and training
alternate; with η > 0 the rollout server generates the next batches while the trainer trains.
Printed, measured in this one run: wall time of the RL phase (first to last step, from the
metrics' timestamps, so process start-up is excluded; total wall time too), the ratio
sync / async (goal >= 1.5x), and the mean reward of the last 10 steps of each (on par).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_mega.demo import cpu_env, prepare, run_rl  # noqa: E402


def step_span(metrics: Path) -> tuple:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    span = rows[-1]["time"] - rows[0]["time"] + rows[0]["time/step"]
    last = [r["reward/mean"] for r in rows[-10:] if "reward/mean" in r]
    return (
        span,
        sum(last) / max(len(last), 1),
        len(rows),
        max(r.get("staleness/max", 0) for r in rows),
    )


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--etas", type=int, nargs="+", default=[0, 2])
    p.add_argument(
        "--weight-update",
        default="auto",
        choices=["auto", "disk", "distributed"],
        help="rollout.weight_update for both runs (auto = disk on CPU)",
    )
    p.add_argument("--out", default=f"runs/bench-async-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = cpu_env()
    model, data, _ = prepare(out, seed=1, sft_steps=args.sft_steps, env=env)
    res = {}
    for eta in args.etas:
        wall = run_rl(
            out / f"eta{eta}",
            model,
            data,
            args.steps,
            eta,
            1,
            env,
            [
                "checkpoint.save_every=0",
                "logging.tensorboard=false",
                f"rollout.weight_update={args.weight_update}",
            ],
        )
        span, reward, n, stale = step_span(out / f"eta{eta}" / "metrics.jsonl")
        res[eta] = dict(span=span, wall=wall, reward=reward, steps=n, staleness=stale)
        print(
            f"eta={eta}: {n} steps, RL span {span:.1f}s ({span / n:.2f}s/step), total wall "
            f"{wall:.1f}s, last-10 reward {reward:.3f}, max staleness {stale:.0f}",
            flush=True,
        )
    base, fast = res[min(args.etas)], res[max(args.etas)]
    print(
        f"\nspeed-up eta={max(args.etas)} vs eta={min(args.etas)}: "
        f"{base['span'] / fast['span']:.2f}x by step span (goal >= 1.5x), "
        f"{base['wall'] / fast['wall']:.2f}x by total wall time"
    )
    print(
        f"final rewards (last 10 steps): eta={min(args.etas)} {base['reward']:.3f}, "
        f"eta={max(args.etas)} {fast['reward']:.3f}"
    )
    (out / "bench_async_vs_sync.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

"""DP balance, micro-batch count and fill of plan_micro_batches vs first-fit-decreasing.

Part 1, for 1024 sequences on 8 DP ranks (goal imbalance <= 1.01) and 64 on 8 (goal <= 1.02):
DP imbalance max/mean of rank token load, micro-batches per rank, fill ratio (real tokens /
(non-empty micro-batches x budget)) and planning time, for ours (Karmarkar-Karp + refine,
then the fewest micro-batches per rank, KK-balanced) and for the common baseline: FFD-pack all
sequences into micro-batches under the budget, then deal micro-batches round-robin to ranks.
Lengths: prompt U(64, 1024) + response lognormal(mu=7, sigma=1) capped at the budget (RL-like).

Part 2, micro-batch count per rank: ours vs FFD on our DP split vs ``ceil(rank tokens /
budget)`` (a lower bound), over 200 seeds per case, including the length distribution of
verl's distributed seqlen-balancing test (valid lengths U[50, 90], 20 rows, 300-token budget).
"""

from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_mega.scheduler.planner import (
    first_fit_decreasing,  # noqa: E402
    plan_micro_batches,
    plan_stats,
)


def lengths(n: int, budget: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [
        min(budget, rng.randint(64, 1024) + int(rng.lognormvariate(7.0, 1.0))) for _ in range(n)
    ]


def ffd_round_robin(lens, dp, budget, pp=1):
    bins = first_fit_decreasing(range(len(lens)), lens, budget)
    m = -(-len(bins) // dp)
    m = -(-m // pp) * pp
    plan = [[] for _ in range(dp)]
    for k, b in enumerate(bins):
        plan[k % dp].append(b)
    for r in plan:
        r.extend([] for _ in range(m - len(r)))
    return plan


def balance_table() -> None:
    budget, dp = 16384, 8
    print(f"budget {budget} tokens/micro-batch, dp={dp}; mean over 5 seeds")
    print(f"{'case':12} {'method':10} {'imbalance':>9} {'mb/rank':>7} {'fill':>6} {'ms':>7}")
    for n, goal in ((1024, 1.01), (64, 1.02)):
        for name, fn in (
            ("KK (ours)", lambda L: plan_micro_batches(L, dp_size=dp, max_tokens_per_mb=budget)),
            ("FFD+RR", lambda L: ffd_round_robin(L, dp, budget)),
        ):
            imb, mbs, fill, ms = [], [], [], []
            for seed in range(5):
                L = lengths(n, budget, seed)
                t0 = time.perf_counter()
                plan = fn(L)
                ms.append((time.perf_counter() - t0) * 1e3)
                st = plan_stats(plan, L, budget)
                imb.append(st["imbalance"])
                mbs.append(st["micro_batches_per_rank"])
                fill.append(st["fill_ratio"])
            print(
                f"{n:>4} on {dp:<4} {name:10} {max(imb):9.4f} {sum(mbs) / 5:7.1f} "
                f"{sum(fill) / 5:6.3f} {sum(ms) / 5:7.1f}"
                + (f"   (goal <= {goal}, worst seed shown)" if name.startswith("KK") else "")
            )


def count_table() -> None:
    cases = [  # name, n, dp, budget, length sampler
        ("verl U[50,90]", 20, 1, 300, lambda r: r.randint(50, 90)),
        ("verl U[50,90]", 45, 2, 300, lambda r: r.randint(50, 90)),
        ("U[.15,.35]B", 64, 2, 4096, lambda r: int(4096 * r.uniform(0.15, 0.35))),
        ("RL lognormal", 256, 8, 16384, None),
    ]
    print(
        "\nmicro-batches per rank over 200 seeds: ours vs FFD (on our DP split) vs "
        "ceil(rank tokens / budget)"
    )
    print(
        f"{'case':14} {'n':>4} {'dp':>3} {'ours<FFD':>9} {'ours=ceil':>9} "
        f"{'sum ours':>8} {'sum FFD':>8} {'sum ceil':>8}"
    )
    for name, n, dp, budget, draw in cases:
        fewer = at_bound = tot_ours = tot_ffd = tot_ceil = 0
        for seed in range(200):
            rng = random.Random(seed)
            L = lengths(n, budget, seed) if draw is None else [draw(rng) for _ in range(n)]
            plan = plan_micro_batches(L, dp_size=dp, max_tokens_per_mb=budget)
            ranks = [[i for mb in r for i in mb] for r in plan]
            ffd = max(len(first_fit_decreasing(r, L, budget)) for r in ranks)
            ceil = max(-(-sum(L[i] for i in r) // budget) for r in ranks)
            ours = len(plan[0])
            fewer += ours < ffd
            at_bound += ours == ceil
            tot_ours, tot_ffd, tot_ceil = tot_ours + ours, tot_ffd + ffd, tot_ceil + ceil
        print(
            f"{name:14} {n:>4} {dp:>3} {fewer / 2:8.1f}% {at_bound / 2:8.1f}% "
            f"{tot_ours:>8} {tot_ffd:>8} {tot_ceil:>8}"
        )


if __name__ == "__main__":
    balance_table()
    count_table()

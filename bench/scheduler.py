"""DP balance and micro-batch fill of plan_micro_batches vs first-fit-decreasing.

Prints, for 1024 sequences on 8 DP ranks (goal imbalance <= 1.01) and 64 on 8 (goal <= 1.02):
DP imbalance max/mean of rank token load, micro-batches per rank, fill ratio (real tokens /
(non-empty micro-batches x budget)) and planning time, for ours (Karmarkar-Karp + refine,
then per-rank KK micro-batches) and for the common baseline: FFD-pack all sequences into
micro-batches under the budget, then deal micro-batches round-robin to ranks.
Lengths: prompt U(64, 1024) + response lognormal(mu=7, sigma=1) capped at the budget (RL-like).
"""
from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_mega.scheduler.planner import (first_fit_decreasing,  # noqa: E402
                                          plan_micro_batches, plan_stats)


def lengths(n: int, budget: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(budget, rng.randint(64, 1024) + int(rng.lognormvariate(7.0, 1.0)))
            for _ in range(n)]


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


def main() -> None:
    budget, dp = 16384, 8
    print(f"budget {budget} tokens/micro-batch, dp={dp}; mean over 5 seeds")
    print(f"{'case':12} {'method':10} {'imbalance':>9} {'mb/rank':>7} {'fill':>6} {'ms':>7}")
    for n, goal in ((1024, 1.01), (64, 1.02)):
        for name, fn in (("KK (ours)", lambda L: plan_micro_batches(
                L, dp_size=dp, max_tokens_per_mb=budget)),
                         ("FFD+RR", lambda L: ffd_round_robin(L, dp, budget))):
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
            print(f"{n:>4} on {dp:<4} {name:10} {max(imb):9.4f} {sum(mbs) / 5:7.1f} "
                  f"{sum(fill) / 5:6.3f} {sum(ms) / 5:7.1f}"
                  + (f"   (goal <= {goal}, worst seed shown)" if name.startswith("KK") else ""))


if __name__ == "__main__":
    main()

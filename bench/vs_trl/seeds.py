"""Reward curves of several bench/vs_trl/run.py runs (other ``--rl-seed``s, other ``--eta``s),
pooled: one seed's curve says little, sampling noise moves it by a step or two.

    for s in 1 2 3; do python -m bench.vs_trl --sft-steps 30 --rl-seed $s --out runs/s$s; done
    python -m bench.vs_trl.seeds runs/s*/vs_trl.json --out runs/seeds.png

Each file adds its TRL curve (once per RL seed: a TRL side reused with ``--trl-from`` counts
once) and its curve of ours under the label ``ours eta=N``. Printed per label: the number of
seeds, the mean reward per step over the seeds, the mean over all steps with each seed's in
brackets, and the median s/step; then whether eta 1 trails eta 0 by its one step of lag and no
more (:func:`lag_check`). With ``--out``: the mean curves with each label's band
(lowest to highest seed) per step.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


def curves(results: list) -> dict:
    """``{label: {rl_seed: {"rewards": [...], "s_per_step": s}}}`` from vs_trl.json dicts (a run
    made with ``--ours-only`` adds its curve of ours and no TRL curve)."""
    out: dict = {}
    for res in results:
        run = res["run"]
        seed = run.get("rl_seed", run["seed"])
        sides = [(f"ours eta={res['ours']['settings']['eta']}", res["ours"])]
        if "trl" in res:
            sides.insert(0, ("TRL", res["trl"]))
        for label, side in sides:
            s = side["summary"]
            out.setdefault(label, {})[seed] = {
                "rewards": s["rewards"],
                "s_per_step": s["s_per_step"],
            }
    return out


def pooled(by_seed: dict) -> dict:
    """Per step the mean over seeds (a step a seed lacks, or logged without a reward, is left
    out), its lowest and highest, each seed's mean over its steps, and the median s/step."""
    runs = list(by_seed.values())
    n_steps = max(len(r["rewards"]) for r in runs)
    mean, low, high = [], [], []
    for i in range(n_steps):
        vals = [
            r["rewards"][i] for r in runs if i < len(r["rewards"]) and r["rewards"][i] is not None
        ]
        mean.append(statistics.fmean(vals) if vals else None)
        low.append(min(vals) if vals else None)
        high.append(max(vals) if vals else None)
    per_seed = {
        seed: statistics.fmean([v for v in r["rewards"] if v is not None])
        for seed, r in sorted(by_seed.items())
    }
    return {
        "seeds": len(runs),
        "mean": mean,
        "low": low,
        "high": high,
        "per_seed": per_seed,
        "overall": statistics.fmean(per_seed.values()),
        "s_per_step": statistics.median(r["s_per_step"] for r in runs),
    }


def report(pools: dict) -> str:
    lines = []
    for label, p in pools.items():
        seeds = ", ".join(f"seed {k}: {v:.3f}" for k, v in p["per_seed"].items())
        lines += [
            f"{label} ({p['seeds']} seeds, median {p['s_per_step']:.2f} s/step): mean "
            f"reward {p['overall']:.3f} ({seeds})",
            "  per step " + " ".join("-" if v is None else f"{v:.3f}" for v in p["mean"]),
        ]
    return "\n".join(lines)


def lag_check(pools: dict, lead: str = "ours eta=0", lagged: str = "ours eta=1") -> dict:
    """Whether ``lagged`` trails ``lead`` by one step and nothing more: at eta 1 the batch a
    step trains on comes from the weights one step older than at eta 0, so if nothing else
    differs, eta 1's mean reward at step ``k + 1`` equals eta 0's at step ``k``. Returns the
    mean difference (lagged - lead) at the same step and with ``lagged`` shifted one step
    earlier, each over the steps both have, and the seeds' spread to hold them against (the
    mean over steps and both labels of half the lowest-to-highest band); empty without both
    labels."""
    if lead not in pools or lagged not in pools:
        return {}
    a, b = pools[lead], pools[lagged]

    def mean_diff(shift: int) -> float:
        pairs = [
            (x, y) for x, y in zip(a["mean"], b["mean"][shift:]) if x is not None and y is not None
        ]
        return statistics.fmean(y - x for x, y in pairs) if pairs else float("nan")

    halves = [
        (hi - lo) / 2
        for p in (a, b)
        for lo, hi in zip(p["low"], p["high"])
        if lo is not None and hi is not None
    ]
    return {
        "same_step": mean_diff(0),
        "shifted": mean_diff(1),
        "spread": statistics.fmean(halves) if halves else float("nan"),
    }


def lag_lines(check: dict) -> list:
    """:func:`lag_check`'s result as the report's lines."""
    if not check:
        return []
    return [
        "ours eta=1 against eta=0, mean reward difference per step: at the same step "
        f"{check['same_step']:+.3f}; eta=1 one step later {check['shifted']:+.3f}; the seeds' "
        f"spread (half the band, mean over steps) {check['spread']:.3f}"
    ]


def plot(pools: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, p in pools.items():
        steps = [i + 1 for i, v in enumerate(p["mean"]) if v is not None]
        pick = [v for v in p["mean"] if v is not None]
        (line,) = ax.plot(steps, pick, marker="o", label=f"{label} ({p['seeds']} seeds)")
        ax.fill_between(
            steps,
            [p["low"][i - 1] for i in steps],
            [p["high"][i - 1] for i in steps],
            color=line.get_color(),
            alpha=0.15,
        )
    ax.set(
        xlabel="step",
        ylabel="mean reward",
        title="reward per step: mean over seeds, band lowest-highest",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="vs_trl.json files")
    p.add_argument("--out", default=None, help="the plot (PNG)")
    a = p.parse_args(argv)
    results = []
    for path in a.runs:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            sys.exit(f"{path}: not a readable vs_trl.json ({e})")
    try:
        pools = {label: pooled(by_seed) for label, by_seed in curves(results).items()}
    except KeyError as e:
        sys.exit(f"a run lacks {e}: not a finished vs_trl.json")
    print(report(pools))
    print("\n".join(lag_lines(lag_check(pools))))
    if a.out:
        print(f"plot: {a.out}" if plot(pools, Path(a.out)) else "no matplotlib: no plot")


if __name__ == "__main__":
    main()

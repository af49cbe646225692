#!/usr/bin/env python
"""LoRA (adapter sync) vs full fine-tuning, the same RL run on the CPU demo task.

    python bench/lora_vs_full.py [--steps 40] [--sft-steps 120] [--hidden 128 --layers 2]
                                 [--rank 8] [--lora-lr 2e-3]

Both runs start from one SFT warm-up of the demo model (``--hidden`` / ``--layers`` make it
bigger) and run the whole system (CPU rollout server, rollout worker, data plane, trainer)
through ``launch.local`` with η = 0, so every step waits for its weight sync. Printed, measured
in this one run, per mode and as ratios full / LoRA: bytes of one published version (a PEFT
adapter vs the full HF weights), mean ``time/weight_sync`` (export + server load), mean
``time/train`` and ``time/step``, the trainer's peak RSS (``mem/trainer_peak_rss_gib``), the
checkpoint size, and the mean reward of the last 10 steps. Machine noise is shared: run it on
a quiet machine and name the CPU (``lscpu``) with the numbers.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_mega.demo import MODEL, cpu_env, prepare, run_rl  # noqa: E402


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def summarise(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    later = rows[1:] or rows  # the first step includes one-off warm-up costs

    def mean(key):
        vals = [r[key] for r in later if isinstance(r.get(key), (int, float))]
        return sum(vals) / max(len(vals), 1)

    published = sorted((run / "weights").iterdir())[-1]
    ckpts = sorted(p for p in (run / "checkpoints").glob("iter_*") if p.is_dir())
    return {
        "steps": len(rows),
        "sync_bytes": dir_bytes(published),
        "weight_sync_s": mean("time/weight_sync"),
        "train_s": mean("time/train"),
        "step_s": mean("time/step"),
        "peak_rss_gib": max(r.get("mem/trainer_peak_rss_gib", 0.0) for r in rows),
        "checkpoint_bytes": dir_bytes(ckpts[-1]) if ckpts else 0,
        "reward_last10": sum(r["reward/mean"] for r in rows[-10:]) / len(rows[-10:]),
    }


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    p.add_argument("--layers", type=int, default=MODEL["num_layers"])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lora-lr", type=float, default=2e-3)
    p.add_argument("--out", default=f"runs/bench-lora-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = cpu_env()
    spec = dict(
        MODEL, hidden_size=args.hidden, num_layers=args.layers, intermediate_size=2 * args.hidden
    )
    model, data, _ = prepare(out, seed=1, sft_steps=args.sft_steps, env=env, model=spec)
    common = [
        "rollout.max_head_offpolicyness=0",
        "logging.tensorboard=false",
        f"checkpoint.save_every={args.steps}",
        "ref.enabled=true",
        "algorithm.kl_coef=0.001",
    ]
    modes = {
        "full": [],
        "lora": [
            "lora.enabled=true",
            f"lora.rank={args.rank}",
            f"lora.alpha={2 * args.rank}",
            f"optimizer.lr={args.lora_lr}",
        ],
    }
    res = {}
    for name, extra in modes.items():
        run_rl(out / name, model, data, args.steps, 0, 1, env, common + extra)
        res[name] = summarise(out / name)
        print(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in res[name].items()), flush=True)
    full, lora = res["full"], res["lora"]
    print("\nfull / LoRA:")
    for k in (
        "sync_bytes",
        "weight_sync_s",
        "train_s",
        "step_s",
        "peak_rss_gib",
        "checkpoint_bytes",
    ):
        print(
            f"  {k:17s} {full[k]:>12.4g} / {lora[k]:<12.4g} = {full[k] / max(lora[k], 1e-12):.2f}x"
        )
    print(f"  reward (last 10)  {full['reward_last10']:.3f} / {lora['reward_last10']:.3f}")
    (out / "bench_lora_vs_full.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

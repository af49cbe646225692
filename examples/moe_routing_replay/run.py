"""MoE routing replay (R3) end to end on a CPU: a tiny qwen3_moe learns the demo task with the
rollout's routes replayed in the trainer.

    python examples/moe_routing_replay/run.py --run-dir runs/moe-r3 [--rl-steps 60]

1. makes a tiny qwen3_moe (the demo's sizes, 8 experts, top-2) and the reverse task, and
   warms it up with SFT (as ``make demo`` does);
2. runs GRPO through ``launch.local`` with ``algorithm.routing_replay=r3``: the CPU rollout
   server returns each token's routed experts (SGLang's ``return_routed_experts``), they travel
   with the trajectory to the trainer, whose routers replay them in the proximal and the
   training forward; one free-routing pass a step (``routing_replay_free_every=1``) measures
   how often the trainer alone would have routed differently;
3. prints the reward over the first and last 10 steps, the routes received (rows that are not
   -1 per MoE layer, against every token a server forwarded), the route agreement and the
   mismatch with and without replay, and whether any sample was trained twice.
"""

import argparse
import json
import time
from pathlib import Path

from areal_mega.demo import MODEL, cpu_env, prepare, run_rl

MOE = dict(MODEL, arch="qwen3_moe", num_experts=8, intermediate_size=128)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run-dir", default=f"runs/moe-r3-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--rl-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="extra RL overrides")
    args = p.parse_args()
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    env = cpu_env()
    model, data, sft_s = prepare(run, args.seed, args.sft_steps, env, model=MOE)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    rl = run / "rl"
    wall = run_rl(
        rl,
        model,
        data,
        args.rl_steps,
        1,
        args.seed,
        env,
        ["algorithm.routing_replay=r3", "algorithm.routing_replay_free_every=1", *args.overrides],
    )
    rows = [r for r in map(json.loads, open(rl / "metrics.jsonl")) if r.get("step")]
    rw = [r["reward/mean"] for r in rows]
    k = min(10, len(rw))
    routed = sum(r.get("moe/route_rows", 0) for r in rows)
    forwarded = sum((r["n_tokens_total"] - r["n_samples"]) * layers for r in rows)
    trained = [s for line in open(rl / "trained.jsonl") for s in json.loads(line)["sample_ids"]]
    free = [r["moe/mismatch_free"] for r in rows if "moe/mismatch_free" in r]
    replay = [r["moe/mismatch_replay"] for r in rows if "moe/mismatch_replay" in r]
    agree = [r["moe/route_agreement"] for r in rows if "moe/route_agreement" in r]
    print(
        json.dumps(
            {
                "steps": len(rows),
                "sft_s": round(sft_s, 1),
                "rl_s": round(wall, 1),
                "reward_first10": sum(rw[:k]) / k,
                "reward_last10": sum(rw[-k:]) / k,
                "route_rows_received": routed,
                "route_rows_forwarded": forwarded,
                "route_agreement_first_last": [agree[0], agree[-1]] if agree else None,
                "mismatch_free_mean": sum(free) / len(free) if free else None,
                "mismatch_replay_mean": sum(replay) / len(replay) if replay else None,
                "samples_trained": len(trained),
                "trained_twice": len(trained) - len(set(trained)),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

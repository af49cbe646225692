#!/bin/bash
# The online-agent learning measurement (docs/workflows.md, "Online RL"): the demo's SFT
# warm-up, then online GRPO on sessions of agents areal-mega does not start.
#
#   bash examples/online_agent/measure.sh [OUT_DIR] [STEPS]     # from the repository root
#
# Prints reward/mean over the first and the last 10 steps; the curve is
# OUT_DIR/rl/reward_curve.png.
set -euo pipefail
OUT=${1:-runs/online-measure}
STEPS=${2:-200}
PY=${PYTHON:-.venv/bin/python}
export CUDA_VISIBLE_DEVICES= TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ ! -d "$OUT/sft/hf_model" ]; then
  "$PY" -c "from pathlib import Path; from areal_mega.demo import prepare, cpu_env; \
print(prepare(Path('$OUT'), 1, 120, cpu_env()))"
fi
rm -rf "$OUT/rl"
"$PY" -m areal_mega.launch.local --config examples/online_agent/config.yaml \
  model.path="$OUT/sft/hf_model" data.train_path="$OUT/data/train.jsonl" \
  data.test_path="$OUT/data/test.jsonl" logging.run_dir="$OUT/rl" rollout.batch_size=16 \
  rollout.n_samples=8 total_steps="$STEPS" optimizer.lr=2e-4 > "$OUT/launch.log" 2>&1 &
LAUNCH=$!
"$PY" examples/online_agent/agent.py all --run-dir "$OUT/rl" --data "$OUT/data/train.jsonl" \
  --agents 4 --group 8 --delay 2 --reward exact --give-up-s 60 > "$OUT/agents.log" 2>&1 &
AGENTS=$!
wait $LAUNCH
wait $AGENTS || true     # the agents give up 60 s after the gateway is gone
"$PY" - "$OUT/rl/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("step")]
rw = [r["reward/mean"] for r in rows]
first, last = sum(rw[:10]) / 10, sum(rw[-10:]) / 10
print(f"steps {len(rows)}: reward/mean first 10 {first:.3f}, last 10 {last:.3f}, "
      f"gain {last - first:+.3f}")
PYEOF

#!/usr/bin/env bash
# launch/torchrun.sh — start the areal-mega trainer on this node under torchrun, joining
# rollout servers that already run elsewhere (SGLang, vLLM or the CPU local server).
#
# Usage (run once per trainer node, e.g. from srun or by hand on each node):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node-a MASTER_PORT=29500 \
#     launch/torchrun.sh recipes/qwen2.5-7b-math.yaml allocation=sglang:d2+megatron:d4t2 \
#       rollout.server_addrs=10.0.0.5:30000,10.0.0.6:30000 [key=value ...]
# (the allocation's rollout part describes the servers: one per address, its t = --tp-size)
# With algorithm.routing_replay: r3 those servers must run with --enable-return-routed-experts
# (launch.local and launch/slurm/run.sbatch add it themselves); otherwise the first /generate
# fails with an error naming the flag. vLLM servers (rollout.backend=vllm, allocation vllm:...)
# need the flags and environment launch.local gives them (worker extension, logprobs mode, key
# middleware, VLLM_SERVER_DEV_MODE=1, the key in VLLM_API_KEY): `python -m
# areal_mega.launch.local --config R --dry-run rollout.backend=vllm ...` prints them.
#
# Environment (all optional):
#   PYTHON          python with areal_mega's dependencies       (default: the repository's
#                   .venv/bin/python when present, else python3)
#   NNODES          trainer nodes                               (default: 1)
#   NODE_RANK       this node's index among them                (default: $SLURM_NODEID or 0)
#   MASTER_ADDR     host of trainer node 0                      (default: 127.0.0.1)
#   MASTER_PORT     free TCP port on MASTER_ADDR                (default: 29500)
#   NPROC_PER_NODE  trainer ranks on this node                  (default: from the layout)
#   TRAINER_GPUS    CUDA_VISIBLE_DEVICES for the trainer        (default: from the layout)
#   START_ROLLOUT_WORKER  0: do not start the rollout worker on node 0 (default: 1)
# The trainer module, ranks per node and GPUs come from the same planner as
# `python -m areal_mega.launch.local --dry-run`, so this script and launch.local agree.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,26p' "$0" >&2
    exit 2
fi
RECIPE=$1
shift
if [[ -z ${PYTHON:-} ]]; then
    venv=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python
    if [[ -x $venv ]]; then PYTHON=$venv; else PYTHON=python3; fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

layout=$("$PYTHON" -m areal_mega.launch.local --config "$RECIPE" --print-layout-env "$@")
eval "$layout"   # TRAINER_NPROC_PER_NODE, TRAINER_GPUS, TRAINER_MODULE, ...
NPROC_PER_NODE=${NPROC_PER_NODE:-$TRAINER_NPROC_PER_NODE}
if [[ -n ${TRAINER_GPUS:-} && -z ${CUDA_VISIBLE_DEVICES:-} ]]; then
    export CUDA_VISIBLE_DEVICES=$TRAINER_GPUS
fi

echo "[torchrun.sh] $(hostname): node ${NODE_RANK}/${NNODES}, ${NPROC_PER_NODE} ranks," \
     "master ${MASTER_ADDR}:${MASTER_PORT}, module ${TRAINER_MODULE}," \
     "rollout backend ${ROLLOUT_BACKEND}" >&2

# The rollout worker (RL mode) runs beside trainer rank 0: its data and control sockets are
# ipc:// files in the run directory unless dataplane.endpoint / control_endpoint say tcp://.
# START_ROLLOUT_WORKER=0 skips it (e.g. when it runs elsewhere).
WORKER_PID=""
stop_worker() {
    if [[ -n $WORKER_PID ]] && kill -0 "$WORKER_PID" 2>/dev/null; then
        kill -TERM "$WORKER_PID" 2>/dev/null || true
        wait "$WORKER_PID" 2>/dev/null || true
    fi
}
trap stop_worker EXIT
trap 'exit 143' TERM INT
if [[ $NODE_RANK == 0 && -n ${ROLLOUT_WORKER_MODULE:-} && ${START_ROLLOUT_WORKER:-1} != 0 ]]; then
    CUDA_VISIBLE_DEVICES="" "$PYTHON" -m "$ROLLOUT_WORKER_MODULE" --config "$RECIPE" "$@" &
    WORKER_PID=$!
    echo "[torchrun.sh] rollout worker ${ROLLOUT_WORKER_MODULE} pid ${WORKER_PID}" >&2
fi

rc=0
"$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m "$TRAINER_MODULE" --config "$RECIPE" "$@" || rc=$?
exit "$rc"

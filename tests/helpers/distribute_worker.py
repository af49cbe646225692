"""Worker for tests/test_train_distribute.py: one gloo rank of a 2-rank trainer mesh.

Usage: python -m tests.helpers.distribute_worker RANK WORLD PORT OUT_DIR. For layouts DP2 and
TP2, rank 0 builds a StepPlan whose DP shares are told apart by their sample ids and sizes, then
every rank calls the production ``batches.distribute`` and records what it received."""

import json
import os
import sys
import traceback

import torch


def plan_for(dp_size):
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import StepPlan

    per_rank = []
    for d in range(dp_size):
        mbs = []
        for m in range(2):
            n = 3 + 50 * d + m  # DP rank 1's share is much larger than DP rank 0's
            mbs.append(
                pack_sequences(
                    [{"input_ids": torch.arange(n), "prompt_len": 1, "sample_id": f"d{d}m{m}"}],
                    pad_to_multiple=2,
                )
            )
        per_rank.append(mbs)
    ids = [mb["sample_ids"][0] for mbs in per_rank for mb in mbs]
    return StepPlan(micro_batches=per_rank, sample_ids=ids, stats={"n_samples": len(ids)})


def run_layout(spec, res):
    import torch.distributed as dist

    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh
    from areal_mega.train import batches

    mesh = ParallelMesh.create(ParallelDims(**spec), timeout_s=90)
    try:
        plan = plan_for(spec.get("dp", 1)) if mesh.rank == 0 else None
        got = batches.distribute(plan, mesh)
        every = [None] * mesh.world_size
        dist.all_gather_object(every, mesh.dp_rank)
        res[f"dp{spec.get('dp', 1)}tp{spec.get('tp', 1)}"] = {
            "dp_rank": mesh.dp_rank,
            "dp_ranks_by_global_rank": mesh.dp_ranks_by_global_rank(),
            "dp_ranks_gathered": every,
            "type": type(got).__name__,
            "fields": sorted(vars(got)),
            "sample_ids": [mb["sample_ids"] for mb in got.micro_batches],
            "n_tokens": [int(mb["cu_seqlens"][-1]) for mb in got.micro_batches],
            "stats": got.stats,
        }
    finally:
        mesh.destroy()


def main():
    rank, world, port, out_dir = sys.argv[1:5]
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    res = {}
    try:
        run_layout({"dp": 2}, res)
        run_layout({"tp": 2}, res)
    except Exception:
        res["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"distribute.{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())

"""One rank of tests/test_parallel_mesh.py: build meshes one after the other (DP2, TP2, ...)
and write this process's thread count after each; then a DP2 mesh that outlives a TP2 mesh
built and destroyed inside it (as a converter's inside a trainer) and the sum of an
all-reduce over its data-parallel group afterwards. With ``engines``: on each mesh a MoE actor
engine (EP2 or TP2) runs a training step before the mesh is destroyed, and the worker also
writes whether each engine's model was freed once dropped.

    python -m tests.helpers.mesh_worker <rank> <world> <port> <out.json> <n_meshes> [engines]
"""

import gc
import json
import os
import sys
import weakref
from pathlib import Path

import torch

from areal_mega.parallel.allocation import ParallelDims
from areal_mega.parallel.mesh import ParallelMesh


def train_step(mesh) -> weakref.ref:
    """A MoE actor engine on ``mesh``, one forward-backward and optimizer step; a weak
    reference to its first model chunk (the engine itself is dropped on return)."""
    from areal_mega.engine import MegatronEngine
    from tests.helpers import engine_worker as ew

    eng = MegatronEngine(
        ew.ModelConfig(dtype="fp32"),
        hf_config=ew.MOE,
        role="actor",
        mesh=mesh,
        optimizer_cfg=ew.OptimizerConfig(lr=1e-3),
        seed=3,
    )
    mbs = ew.make_mbs(1, [[9, 14, 5], [20, 3]])
    eng.forward_backward(mbs, *ew.losses("sft"))
    eng.optimizer_step()
    return weakref.ref(eng.model[0])


def main(rank: int, world: int, port: int, out: Path, n: int, engines: bool = False) -> None:
    threads, mesh, freed = [], None, []
    for i in range(n):
        if mesh is not None:
            mesh.destroy()
        dims = ParallelDims(tp=2) if i % 2 else ParallelDims(dp=2, ep=2 if engines else 1)
        mesh = ParallelMesh.create(
            dims,
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout_s=120,
            sequence_parallel=engines and dims.tp > 1,  # megatron's rule for MoE with TP
        )
        if engines:
            model = train_step(mesh)
            gc.collect()
            freed.append(model() is None)
        threads.append(len(os.listdir(f"/proc/{os.getpid()}/task")))
    mesh.destroy()
    outer = ParallelMesh.create(ParallelDims(dp=2), rank=rank, world_size=world)
    inner = ParallelMesh.create(ParallelDims(tp=2), rank=rank, world_size=world)
    inner.destroy()
    x = torch.ones(1)
    torch.distributed.all_reduce(x, group=outer.dp_group)
    outer.destroy(process_group=True)
    out.write_text(json.dumps({"threads": threads, "outer_sum": x.item(), "freed": freed}))


if __name__ == "__main__":
    r, w, p, o, n, *mode = sys.argv[1:]
    main(int(r), int(w), int(p), Path(o), int(n), engines=mode == ["engines"])

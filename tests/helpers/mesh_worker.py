"""One rank of tests/test_parallel_mesh.py: build meshes one after the other (DP2, TP2, ...)
and write this process's thread count after each; then a DP2 mesh that outlives a TP2 mesh
built and destroyed inside it (as a converter's inside a trainer) and the sum of an
all-reduce over its data-parallel group afterwards.

    python -m tests.helpers.mesh_worker <rank> <world> <port> <out.json> <n_meshes>
"""

import json
import os
import sys
from pathlib import Path

import torch

from areal_mega.parallel.allocation import ParallelDims
from areal_mega.parallel.mesh import ParallelMesh


def main(rank: int, world: int, port: int, out: Path, n: int) -> None:
    threads, mesh = [], None
    for i in range(n):
        if mesh is not None:
            mesh.destroy()
        dims = ParallelDims(tp=2) if i % 2 else ParallelDims(dp=2)
        mesh = ParallelMesh.create(
            dims,
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout_s=120,
        )
        threads.append(len(os.listdir(f"/proc/{os.getpid()}/task")))
    mesh.destroy()
    outer = ParallelMesh.create(ParallelDims(dp=2), rank=rank, world_size=world)
    inner = ParallelMesh.create(ParallelDims(tp=2), rank=rank, world_size=world)
    inner.destroy()
    x = torch.ones(1)
    torch.distributed.all_reduce(x, group=outer.dp_group)
    outer.destroy(process_group=True)
    out.write_text(json.dumps({"threads": threads, "outer_sum": x.item()}))


if __name__ == "__main__":
    r, w, p, o, n = sys.argv[1:]
    main(int(r), int(w), int(p), Path(o), int(n))

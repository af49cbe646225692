"""One rank of tests/test_parallel_mesh.py: build meshes one after the other (DP2, TP2, ...)
and write this process's thread count after each.

    python -m tests.helpers.mesh_worker <rank> <world> <port> <out.json> <n_meshes>
"""

import json
import os
import sys
from pathlib import Path

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
    mesh.destroy(process_group=True)
    out.write_text(json.dumps({"threads": threads}))


if __name__ == "__main__":
    r, w, p, o, n = sys.argv[1:]
    main(int(r), int(w), int(p), Path(o), int(n))

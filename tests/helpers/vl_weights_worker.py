"""One rank of tests/test_vl_weights.py: the engine's Qwen2.5-VL on the converted checkpoint at
a layout, exported through the production path (``train.weights.export_hf_dir``).

    python -m tests.helpers.vl_weights_worker <layout> <hf_dir> <mcore_dir> <rank> <world> \\
        <port> <out_dir>

``one`` (a single rank), ``tp2``, ``pp2``, ``tp2pp2``. Writes the HF directory
``<out_dir>/<layout>`` (rank 0 writes the index, each stage's export source its shard).
"""

import os
import sys

import torch


def main(layout, hf_dir, mcore_dir, rank, world, port, out_dir):
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    from areal_mega.config import ModelConfig, OptimizerConfig
    from areal_mega.engine.megatron_engine import MegatronEngine
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh
    from areal_mega.train.weights import export_hf_dir

    dims = {"one": {}, "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2pp2": dict(tp=2, pp=2)}
    mesh = ParallelMesh.create(ParallelDims(**dims[layout]), timeout_s=90)
    eng = MegatronEngine(
        ModelConfig(path=str(hf_dir), dtype="fp32"),
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-3),
        seed=1,
    )
    eng.load(mcore_dir)
    export_hf_dir(eng, hf_dir, os.path.join(out_dir, layout), is_writer=int(rank) == 0)
    mesh.destroy(process_group=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

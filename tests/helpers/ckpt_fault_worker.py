"""Single-process jobs for tests/test_checkpoint_integrity.py (run as a script: megatron's
parallel state and writer processes need a fresh process).

    python -m tests.helpers.ckpt_fault_worker make WORK ROOT
        tiny Qwen2 -> WORK/hf, WORK/mcore; then from it 2 training steps, saving ROOT/iter 1 and 2
    python -m tests.helpers.ckpt_fault_worker resume WORK ROOT
        what the trainer does on recover=auto

Each writes a JSON result to stdout's last line.
"""

import json
import logging
import math
import sys
from pathlib import Path

from areal_mega.common.net import free_port


def _setup(work):
    """A one-rank trainer of WORK/hf built by the engine's own builders
    (:mod:`areal_mega.engine.optim`: DDP, the regular Adam, a constant LR of 1e-3) and a
    fixed batch."""
    import torch

    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.config import OptimizerConfig
    from areal_mega.engine.optim import build_lr_scheduler, build_optimizer, wrap_ddp
    from areal_mega.models.builder import build_model_chunks
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh

    mesh = ParallelMesh.create(
        ParallelDims(),
        timeout_s=120,
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{free_port()}",
    )
    arch = hm.read_arch(Path(work) / "hf")
    chunks, cfg = build_model_chunks(arch, mesh, seed=3)
    oc = OptimizerConfig(lr=1e-3, clip_grad=0.0, lr_decay_steps=10, use_distributed_optimizer=False)
    ddp = wrap_ddp(cfg, chunks, mesh.pg_collection, False)
    opt = build_optimizer(oc, cfg, ddp, False, mesh.pg_collection)
    sched = build_lr_scheduler(opt, oc, total_train_steps=None)
    ids = torch.randint(3, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return ddp, opt, sched, ids


def _step(ddp, opt, sched, ids):
    import torch
    from megatron.core.distributed import finalize_model_grads

    for m in ddp:
        m.zero_grad_buffer()
    opt.zero_grad()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    loss = (
        ddp[0](
            input_ids=ids, position_ids=pos, attention_mask=None, labels=torch.roll(ids, -1, dims=1)
        )
        .float()
        .mean()
    )
    loss.backward()
    finalize_model_grads(ddp)
    opt.step()
    sched.step(1)
    return float(loss)


def main(mode, work, root=None):
    work = Path(work)
    out = {}
    if mode == "make":  # converted and trained in one process, as the trainer does
        from areal_mega.checkpoint.convert import convert_hf_to_mcore
        from areal_mega.checkpoint.dist_ckpt import load_checkpoint, save_checkpoint
        from areal_mega.models.tiny import make_tiny_model

        hf = make_tiny_model(work / "hf", arch="qwen2", tie_word_embeddings=False)
        out["path"] = convert_hf_to_mcore(hf, work / "mcore", progress=False)["path"]
        ddp, opt, sched, ids = _setup(work)
        load_checkpoint(work / "mcore", ddp)
        out["losses"] = []
        for it in (1, 2):
            out["losses"].append(_step(ddp, opt, sched, ids))
            save_checkpoint(root, it, ddp, opt, sched, extra={"step": it}, hf_dir=work / "hf")
    elif mode == "resume":
        from areal_mega.checkpoint.dist_ckpt import (
            CheckpointError,
            latest_verified,
            load_checkpoint,
        )

        seen = []
        handler = logging.Handler()
        handler.emit = lambda rec: seen.append(rec.getMessage())
        logging.getLogger("areal_mega").addHandler(handler)
        ddp, opt, sched, ids = _setup(work)
        try:
            latest = latest_verified(root)
            loaded = load_checkpoint(latest, ddp, opt, sched)
            out.update(
                path=str(latest),
                iteration=loaded.iteration,
                extra=loaded.extra,
                loaded_optimizer=loaded.loaded_optimizer,
            )
            loss = _step(ddp, opt, sched, ids)
            out["loss"] = loss if math.isfinite(loss) else str(loss)
        except CheckpointError as e:
            out["error"] = str(e)
        out["warnings"] = seen
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])

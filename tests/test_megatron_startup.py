"""What a process pays to start megatron-core: megatron-core's import skips wandb (our trackers
still import it) and, on a CPU, torch.compile's fusions (megatron's jit_fuser leaves functions
plain; dynamo and inductor are not imported); a checkpoint save spawns no multiprocessing
Manager process. Each leans on megatron-core internals; these tests notice when a release moves
them (the savings then go, the behaviour stays)."""

import textwrap

from tests.helpers.workers import BARE_ENV, run_code

CHILD = textwrap.dedent("""
    import json, queue, sys
    import psutil
    from areal_mega.compat.megatron_import import import_megatron_core
    import_megatron_core()
    import megatron.core.timers as timers
    out = {"wandb_skipped": timers.wandb is None and "wandb" not in sys.modules}
    from areal_mega.compat.megatron_import import jit_fuser_is_plain
    from megatron.core.fusions import fused_bias_geglu
    out["jit_plain"] = jit_fuser_is_plain() and type(fused_bias_geglu.geglu).__name__
    out["dynamo"] = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
    import wandb                                   # our tracker's import still works
    out["wandb_after"] = wandb.__name__
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.checkpoint.dist_ckpt import atomic_save_sharded, verify_checkpoint
    mesh = _single_process_mesh()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    final = atomic_save_sharded(sys.argv[1], 1, {"w": ShardedTensor.from_rank_offsets("w", t)})
    verify_checkpoint(final)
    out["queue_in_process"] = isinstance(filesystem_async._results_queue, queue.Queue)
    out["children"] = [p.name() for p in psutil.Process().children(recursive=True)]
    mesh.destroy(process_group=True)
    print(json.dumps(out))
""")


def test_megatron_starts_without_wandb_and_saves_without_a_manager_process(tmp_path):
    out = run_code(CHILD, tmp_path / "ckpt", env=dict(BARE_ENV, HOME=str(tmp_path)), timeout=300)
    assert out == {
        "wandb_skipped": True,
        "jit_plain": "function",
        "dynamo": [],
        "wandb_after": "wandb",
        "queue_in_process": True,
        "children": [],
    }, out


IMPLICIT = textwrap.dedent("""
    import json, sys
    import torch
    from areal_mega.models import varlen_attention   # imports megatron.core at its top
    import megatron.core as mc
    import megatron.core.timers as timers
    from areal_mega.compat.megatron_import import jit_fuser_is_plain
    from megatron.core.activations import squared_relu
    x = torch.tensor([-1.0, 2.0])
    print(json.dumps({
        "loader": type(mc.__loader__).__name__,
        "wandb": timers.wandb is None,
        "jit_plain": jit_fuser_is_plain(),
        "dynamo": "torch._dynamo" in sys.modules,
        "squared_relu": squared_relu(x).tolist(),
        "compile": torch.compile.__module__,
    }))
""")


def test_the_first_megatron_import_anywhere_in_areal_mega_is_the_plain_one(tmp_path):
    """A module of ours that imports megatron-core at its top (not through
    ``import_megatron_core``) gets the same first import: ``import areal_mega`` put the finder
    there. megatron's decorated functions run eagerly; ``torch.compile`` is torch's again."""
    out = run_code(IMPLICIT, env=BARE_ENV, timeout=300)
    assert out == {
        "loader": "SourceFileLoader",
        "wandb": True,
        "jit_plain": True,
        "dynamo": False,
        "squared_relu": [0.0, 4.0],
        "compile": "torch",
    }, out

"""Non-finite training steps and checkpoints in real gloo processes, run by
tests/test_nonfinite_steps.py.

    python -m tests.helpers.nonfinite_worker dp2 <rank> <world> <port> <out_dir>

``dp2`` (2 ranks, DP2, the distributed optimizer, the production policy loss): rank 1 alone
gets NaN advantages in one micro-batch; the step is skipped on both ranks (no update, LR
schedule unmoved) and :class:`~areal_mega.train.nonfinite.SkipGuard` names the advantages on
both; a clean step then applies; two poisoned steps in a row stop the run (``check``). A
weight set to NaN on rank 1 makes ``save_checkpoint`` refuse on both ranks, writing nothing;
a checkpoint holding NaN (as written before the check existed, through the lower-level
``atomic_save_sharded``) is refused by ``load_checkpoint``. A forward on a token id outside
the vocabulary raises an error that names the micro-batch's samples. Rank r writes
``<out_dir>/dp2.<r>.json``.
"""

import math
import os
import sys

import torch

from tests.helpers import engine_worker as ew


def _params(eng):
    return {n: p.detach().clone() for c in eng.model for n, p in c.named_parameters()}


def _moved(eng, before):
    return max(
        float((p.detach() - before[n]).abs().max())
        for c in eng.model
        for n, p in c.named_parameters()
    )


def scenario_dp2(res, out_dir):
    from areal_mega.algo import finalize_stats
    from areal_mega.checkpoint.dist_ckpt import (
        NonFiniteWeightsError,
        _layout,
        _model_sharded_sd,
        atomic_save_sharded,
        load_checkpoint,
        save_checkpoint,
    )
    from areal_mega.config import ModelConfig, OptimizerConfig
    from areal_mega.engine import MegatronEngine
    from areal_mega.train.batches import merge_train_stats
    from areal_mega.train.nonfinite import NonFiniteStepsError, SkipGuard

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    mesh = ew.set_mesh(dict(dp=world))
    eng = MegatronEngine(
        ModelConfig(dtype="fp32"),
        hf_config=ew.DENSE,
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-3, clip_grad=1.0),
        seed=7,
    )
    mbs = ew.make_mbs(1 + rank, [[9, 14, 5], [20, 3]])
    for i, (mb, lp) in enumerate(zip(mbs, eng.forward_logprobs(mbs, temperature=ew.TEMP))):
        ew.attach_policy_inputs(mb, lp, 10 * rank + i)
    fns = ew.losses(ew.POLICY)
    clean_adv = [mb["advantages"].clone() for mb in mbs]

    def poison():
        if rank == 1:
            mbs[0]["advantages"][3] = math.nan

    def heal():
        for mb, a in zip(mbs, clean_adv):
            mb["advantages"] = a.clone()

    guard = SkipGuard(max_consecutive=2)
    before, lr_steps = _params(eng), eng.step_count
    poison()
    st = eng.train_batch(mbs, *fns, temperature=ew.TEMP)
    res["skip.skipped"] = st["skipped"]
    res["skip.nonfinite_loss"] = st["nonfinite_loss"]
    res["skip.nonfinite_grad"] = st["nonfinite_grad"]
    res["skip.moved"] = _moved(eng, before)
    res["skip.step_count_moved"] = eng.step_count - lr_steps
    merged = merge_train_stats([st], finalize_stats)
    res["skip.merged_keys"] = sorted(merged)
    res["skip.metrics"] = guard.record(1, merged, mbs)
    guard.check()  # one skip: the run goes on

    heal()
    st = eng.train_batch(mbs, *fns, temperature=ew.TEMP)
    res["clean.skipped"] = st["skipped"]
    res["clean.moved"] = _moved(eng, before)
    res["clean.step_count_moved"] = eng.step_count - lr_steps
    res["clean.metrics"] = guard.record(2, merge_train_stats([st], finalize_stats), mbs)

    for step in (3, 4):  # two in a row: the run stops
        poison()
        st = eng.train_batch(mbs, *fns, temperature=ew.TEMP)
        guard.record(step, merge_train_stats([st], finalize_stats), mbs)
    try:
        guard.check()
        res["stop.message"] = None
    except NonFiniteStepsError as e:
        res["stop.message"] = str(e)
    res["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in _params(eng).values())

    root = os.path.join(out_dir, "ckpt")
    chunks = eng.model_chunks()
    save_checkpoint(root, 1, chunks, eng.optimizer, eng.lr_scheduler)
    p = next(chunks[0].parameters())
    good = p.detach().clone()
    if rank == 1:
        p.data[0, 0] = math.nan
    try:
        save_checkpoint(root, 2, chunks, eng.optimizer, eng.lr_scheduler)
        res["save.refused"] = None
    except NonFiniteWeightsError as e:
        res["save.refused"] = str(e)
    res["save.iter2_exists"] = os.path.exists(os.path.join(root, "iter_0000002"))
    # a checkpoint of NaN weights as an older version wrote it (no check on saving); the
    # replicated weight is saved from rank 0's copy, so the NaN is set on every rank
    p.data[0, 0] = math.nan
    atomic_save_sharded(
        root,
        3,
        _model_sharded_sd(chunks),
        meta={
            "layout": _layout(),
            "extra": {},
            "has_optimizer": False,
            "optimizer_format": None,
            "has_lr_scheduler": False,
            "has_rng": False,
            "num_chunks": len(chunks),
        },
    )
    p.data.copy_(good)
    try:
        load_checkpoint(os.path.join(root, "iter_0000003"), chunks)
        res["load.refused"] = None
    except NonFiniteWeightsError as e:
        res["load.refused"] = str(e)
    loaded = load_checkpoint(
        os.path.join(root, "iter_0000001"), chunks, eng.optimizer, eng.lr_scheduler
    )
    res["load.good_iteration"] = loaded.iteration

    # last (no collective after it): a sample whose token id is outside the vocabulary makes
    # the forward raise; the error names the samples of the micro-batch it was raised on
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_layout

    seqs = [
        {**next_token_layout(torch.tensor(ids)), "prompt_len": 1, "sample_id": f"r{rank}-{i}"}
        for i, ids in enumerate(([5, 6, 7, 8], [9, 10, 4 * ew.VOCAB, 11, 12]))
    ]
    try:
        eng.forward_logprobs([pack_sequences(seqs, pad_to_multiple=2)], temperature=1.0)
        res["blame.sample_ids"] = None
    except Exception as e:  # noqa: BLE001 - what the trainer's main would record
        res["blame.error"] = f"{type(e).__name__}: {e}"
        res["blame.sample_ids"] = getattr(e, "sample_ids", None)


if __name__ == "__main__":
    sys.exit(ew.run_scenario({"dp2": scenario_dp2}))

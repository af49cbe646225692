"""A reward model's ``score`` head as the critic's start, in gloo processes; run by
tests/test_critic_score_model.py.

    python -m tests.helpers.score_critic_worker <rank> <world> <port> <hf_dir> <out_dir>

World 1 first converts ``hf_dir`` (a one-label ``*ForSequenceClassification``) with the
session's critic conversion (``convert_hf_to_mcore(value_model=True)``) into
``<out_dir>/mcore``; every run then builds a TP=world critic from ``hf_dir``, loads it with
:func:`~areal_mega.train.critic_step.init_critic` (trunk from the conversion, head from
``score.weight``) and writes the values of the packed batch of ``<out_dir>/seqs.json``, one
list per sequence, to ``<out_dir>/tp<world>.<rank>.json``.
"""

import json
import os
import sys
import traceback

import torch

from tests.helpers import engine_worker as ew


def packed_batch(seqs):
    """One packed micro-batch of the token lists ``seqs`` (as the RL step packs them)."""
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_layout

    items = []
    for ids in seqs:
        t = torch.tensor(ids, dtype=torch.long)
        items.append({"input_ids": t, "prompt_len": 1, **next_token_layout(t)})
    return pack_sequences(items, pad_to_multiple=2)


def run(world, hf_dir, out_dir):
    from areal_mega.checkpoint.convert import convert_hf_to_mcore
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.config import CriticConfig, ModelConfig, OptimizerConfig
    from areal_mega.engine.critic import CriticEngine, critic_optimizer_config
    from areal_mega.train.critic_step import init_critic

    mcore = os.path.join(out_dir, "mcore")
    res = {}
    if world == 1:
        res["convert"] = convert_hf_to_mcore(hf_dir, mcore, value_model=True, progress=False)[
            "path"
        ]
    ew.set_mesh(dict(tp=world))
    ocfg = critic_optimizer_config(OptimizerConfig(clip_grad=0.0), CriticConfig())
    critic = CriticEngine(
        ModelConfig(dtype="fp32"),
        hf_config=hf_dir,
        mesh=ew.MESH[0],
        optimizer_cfg=ocfg,
        seed=3,
        use_distributed_optimizer=False,
    )
    init_critic(
        critic,
        lambda views, hf: load_checkpoint(mcore, views, load_optimizer=False, load_rng=False),
        hf_dir,
    )
    with open(os.path.join(out_dir, "seqs.json")) as f:
        seqs = json.load(f)
    mb = packed_batch(seqs)
    values = critic.forward_values([mb])[0]
    starts = mb["cu_seqlens_padded"][:-1].tolist()
    res["values"] = [values[s : s + len(ids)].tolist() for s, ids in zip(starts, seqs)]
    return res


def main():
    rank, world, port, hf_dir, out_dir = sys.argv[1:6]
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    try:
        res = run(int(world), hf_dir, out_dir)
    except Exception:
        res = {"error": traceback.format_exc()}
    return ew.finish_rank(res, os.path.join(out_dir, f"tp{world}.{rank}.json"))


if __name__ == "__main__":
    sys.exit(main())

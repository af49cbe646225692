"""One rank of tests/test_vl_critic.py: the critic (PPO value model) of a vision-language
student through production code, on the tiny Qwen2.5-VL.

    python -m tests.helpers.vl_critic_worker <layout> <hf_dir> <mcore_dir> <rank> <world> \\
        <port> <out_dir>

``layout``: ``single`` (one rank), ``frozen`` (one rank, ``model.freeze_vision=true``),
``dp2``, ``tp2``. The step's trajectories with images are
tests/helpers/vl_trainer_worker.py's (the same on every rank); rank 0 plans them
(``plan_step`` with the VisionSpec), ``distribute`` hands each rank its share. The critic is
``critic_step.build_critic`` of a GAE config, its trunk loaded from the converted VL checkpoint
by ``init_critic`` (head fresh); then ``gae_step`` (values, GAE, whitened advantages) and
``train_critic`` (the clipped value loss), as ``trainer.rl_step`` runs them, and the values
after the step. The control: the same micro-batches with other pictures (each image's pixels
replaced by other random pixels) through the same critic. ``single`` also saves the trained
critic (``save_critic``), restores it into a fresh critic (``load_critic``) and reads its
values.

Writes ``<out_dir>/<layout>.<rank>.json``: per sample id the values at its loss tokens
(``values``: before the step, ``other``: with other pictures, ``after``: after the step,
``restored``: of the restored critic; ``hf``: transformers' final hidden states with the
images times the fresh head, ``single`` only), its ``advantages`` and ``returns``, the step's
``critic/*`` and ``adv/*`` stats, ``vision_moved`` (the largest change of a vision tower
parameter in the step, its projector left out), ``merger_moved`` (the projector's),
``n_vision`` (vision tower parameters seen) and ``head_shape`` (the value head's weight:
[1, H]).
"""

import json
import os
import sys

import torch

from tests.helpers.vl_trainer_worker import N, per_sample, trajectories


def other_pictures(mbs, seed: int = 5) -> list:
    """The micro-batches with every image's pixels replaced by other random pixels (the
    processor's normalised range), grids and tokens unchanged."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for mb in mbs:
        mb = dict(mb)
        pv = mb.get("pixel_values")
        if pv is not None and len(pv):
            pv = torch.as_tensor(pv)
            mb["pixel_values"] = torch.randn(pv.shape, generator=gen, dtype=pv.dtype)
        out.append(mb)
    return out


def vision_params(critic) -> dict:
    inner = critic.model[0].module
    return {n: p.detach().clone() for n, p in inner.named_parameters() if n.startswith("visual.")}


def hf_values(hf_dir, trajs, mbs, head: torch.Tensor) -> dict:
    """Sample id -> transformers' values at its loss tokens: the final-norm hidden states of
    ``Qwen2_5_VLModel`` on the sample with its images, times the critic's head weight (what the
    critic computes when its trunk is the checkpoint's)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    image_token = model.config.image_token_id
    keep = {}
    for mb in mbs:
        for b, sid in enumerate(mb["sample_ids"]):
            lo = int(mb["cu_seqlens_padded"][b])
            keep[sid] = mb["loss_mask"][lo : lo + int(mb["seqlens"][b])].bool()
    out = {}
    for t in trajs:
        if t.sample_id not in keep:
            continue
        ids = torch.as_tensor(t.input_ids).long()
        kw = {}
        if t.multimodal:
            kw = dict(
                pixel_values=torch.as_tensor(t.multimodal["pixel_values"]),
                image_grid_thw=torch.as_tensor(t.multimodal["image_grid_thw"]),
                mm_token_type_ids=(ids == image_token).long()[None],
            )
        with torch.no_grad():
            h = model.model(input_ids=ids[None], **kw).last_hidden_state[0]
        v = h.double() @ head.detach().double().reshape(-1)
        out[t.sample_id] = v[keep[t.sample_id]].tolist()
    return out


def main(layout, hf_dir, mcore_dir, rank, world, port, out_dir):
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.config import load_config
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh
    from areal_mega.train import batches
    from areal_mega.train.critic_step import (
        build_critic,
        gae_step,
        init_critic,
        load_critic,
        save_critic,
        train_critic,
    )

    trajs, spec = trajectories(hf_dir)
    dims = {"single": {}, "frozen": {}, "dp2": dict(dp=2), "tp2": dict(tp=2)}[layout]
    mesh = ParallelMesh.create(ParallelDims(**dims), timeout_s=120)
    cfg = load_config(
        None,
        [
            "mode=rl",
            f"model.path={hf_dir}",
            "model.dtype=fp32",
            f"rollout.n_samples={N}",
            "scheduler.max_tokens_per_mb=48",
            "algorithm.adv_estimator=gae",
            "algorithm.kl_coef=0.0",
            "critic.enabled=true",
            "critic.lr=1e-3",
            "critic.clip_grad=0.0",
            "optimizer.use_distributed_optimizer=false",
            f"model.freeze_vision={str(layout == 'frozen').lower()}",
        ],
    )
    d = mesh.dims
    plan = (
        batches.plan_step(
            trajs, cfg, dp_size=d.dp, tp_size=d.tp, pp_size=d.pp, cp_size=1, vision=spec
        )
        if mesh.rank == 0
        else None
    )
    mbs = batches.distribute(plan, mesh).micro_batches
    mbs = batches.attach(mbs, policy_version=[0] * len(mbs))

    def load_trunk(views, _hf):  # the session's load of the converted start checkpoint
        load_checkpoint(mcore_dir, views, None, load_optimizer=False, load_rng=False)

    critic = build_critic(cfg, mesh)
    init_critic(critic, load_trunk, str(hf_dir))
    head = critic.head_parameter()
    fresh_head = None if head is None else head.detach().clone()
    other = critic.forward_values(other_pictures(mbs))
    before = vision_params(critic)
    mbs, adv_stats = gae_step(critic, mbs, cfg, mesh)
    stats = train_critic(critic, mbs, cfg)
    moved = {"tower": 0.0, "merger": 0.0}  # the projector trains under freeze_vision too
    for n, p in critic.model[0].module.named_parameters():
        if n in before:
            part = "merger" if ".merger." in n else "tower"
            moved[part] = max(moved[part], float((p.detach() - before[n]).abs().max()))
    after = critic.forward_values(mbs)
    res = {
        "values": per_sample(mbs, [mb["values"] for mb in mbs]),
        "other": per_sample(mbs, other),
        "after": per_sample(mbs, after),
        "advantages": per_sample(mbs, [mb["advantages"] for mb in mbs]),
        "returns": per_sample(mbs, [mb["returns"] for mb in mbs]),
        "stats": {**adv_stats, **stats},
        "vision_moved": moved["tower"],
        "merger_moved": moved["merger"],
        "n_vision": len(before),
        "head_shape": None if head is None else list(head.shape),
    }
    if layout == "single":
        root = os.path.join(out_dir, "ckpt")
        save_critic(critic, root, 1, keep_last=1)
        fresh = build_critic(cfg, mesh)
        load_critic(fresh, root, 1)
        res["restored"] = per_sample(mbs, fresh.forward_values(mbs))
        res["hf"] = hf_values(hf_dir, trajs, mbs, fresh_head)
    mesh.destroy(process_group=True)
    with open(os.path.join(out_dir, f"{layout}.{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:8])

"""One rank of tests/test_vl_trainer_layouts.py: a real RL step's data path on the tiny
Qwen2.5-VL, through production code from trajectories with images to the loss.

    python -m tests.helpers.vl_trainer_worker <layout> <hf_dir> <mcore_dir> <rank> <world> \\
        <port> <out_dir>

``layout``: ``single`` (one rank), ``dp2``, ``tp2``, ``pp2``. Every rank builds the same
trajectories: prompt groups of N samples, each group's prompt with its own images
(``encode_sample`` with the model's processor; one group text only), completions of digits
whose behaviour logprobs are transformers' with the images (version 0). Rank 0 plans the step
(``train.batches.plan_step`` with the model's VisionSpec), ``distribute`` hands each rank its
share; then as ``trainer.rl_step`` does: ``policy_version`` attached, ``prox_logprobs`` from
the actor's forward, ``ref_logprobs`` from a reference engine, the policy loss of
``make_policy_loss`` (GRPO with a KL term) in one ``train_batch``; OPD's teacher logprobs
(``opd_step``, an in-trainer teacher on the same checkpoint) on the side.

Writes ``<out_dir>/<layout>.<rank>.json``: per sample id the logprobs on its loss tokens
(``prox``, ``ref``, ``teacher``: OPD's in-trainer teacher through ``opd_step``, ``behav``:
transformers'), ``opd_abs_log_ratio``, the step's ``loss`` / ``grad_norm`` /
``mismatch`` / ``mismatch_tokens`` (finalised like the trainer's), the vision tower's
per-parameter gradient norms (``vision``; empty off the first pipeline stage), the language
model's gradient norm (``lm_grad_norm``) and per micro-batch ``[images, image grid rows]``.
"""

import json
import os
import sys
import types

import numpy as np
import torch

N = 3  # samples per prompt group
#: per prompt group: text with one <|image_pad|> per image, image sizes (height, width)
PROMPTS = [
    ("<|vision_start|><|image_pad|><|vision_end|>1+2=", [(56, 28)]),
    (
        "<|vision_start|><|image_pad|><|vision_end|>3*<|vision_start|><|image_pad|><|vision_end|>=",
        [(28, 28), (56, 56)],
    ),
    ("7-3=", []),
    ("<|vision_start|><|image_pad|><|vision_end|>9?", [(28, 56)]),
]


def trajectories(hf_dir):
    """The step's trajectories (the same on every rank) and the model's VisionSpec."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from areal_mega.dataplane.trajectory import Trajectory
    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.config import vision_spec
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor

    tok = AutoTokenizer.from_pretrained(hf_dir)
    proc = load_image_processor(hf_dir)
    hf = load_hf_config(hf_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    rng = np.random.default_rng(0)
    out = []
    for g, (text, sizes) in enumerate(PROMPTS):
        imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        s = encode_sample(text, imgs, tok, proc)
        mm = (
            {"pixel_values": s.pixel_values, "image_grid_thw": s.image_grid_thw}
            if s.pixel_values is not None
            else {}
        )
        for k in range(N):
            completion = torch.tensor(rng.choice(digits, 2 + 2 * k + g % 2))
            ids = torch.cat([s.input_ids, completion])
            kw = {}
            if mm:
                kw = dict(
                    **mm, mm_token_type_ids=torch.cat([s.mm_token_type_ids, 0 * completion])[None]
                )
            with torch.no_grad():
                logits = model(input_ids=ids[None], **kw).logits[0]
            lp = torch.log_softmax(logits.double(), -1)[:-1].gather(1, ids[1:, None])[:, 0]
            n_p = len(s.input_ids)
            out.append(
                Trajectory.from_tokens(
                    s.input_ids,
                    completion,
                    lp[n_p - 1 :].float(),
                    np.zeros(len(completion), np.int32),
                    reward=float((k + g) % 2),
                    sample_id=f"g{g}-s{k}",
                    group_id=f"g{g}",
                    multimodal=mm,
                ).validate()
            )
    return out, vision_spec(hf)


def per_sample(mbs, values) -> dict:
    """Sample id -> the values at its loss tokens (next-token layout)."""
    out = {}
    for mb, v in zip(mbs, values):
        for b, sid in enumerate(mb["sample_ids"]):
            lo = int(mb["cu_seqlens_padded"][b])
            hi = lo + int(mb["seqlens"][b])
            keep = mb["loss_mask"][lo:hi].bool()
            out[sid] = torch.as_tensor(v)[lo:hi][keep].double().tolist()
    return out


def grad_norms(eng, mesh) -> tuple:
    """The vision tower's per-parameter gradient norms (full tensors on every rank of the
    first stage) and the language model's gradient norm (TP shards' squares summed over TP and
    the pipeline stages; the tied output layer's last-stage copy left out)."""
    import torch.distributed as dist

    vision, lm_sq = {}, torch.zeros((), dtype=torch.float64)
    inner = eng.model[0].module
    tied_copy = not mesh.is_first_stage and inner.share_embeddings_and_output_weights
    for n, p in inner.named_parameters():
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        if n.startswith("visual."):
            vision[n] = float(g.detach().double().norm())
        elif tied_copy and n.endswith("output_layer.weight"):
            continue
        elif getattr(p, "tensor_model_parallel", False) or mesh.tp_rank == 0:
            lm_sq += g.detach().double().pow(2).sum()
    if mesh.dims.tp > 1:
        dist.all_reduce(lm_sq, group=mesh.tp_group)
    if mesh.dims.pp > 1:
        dist.all_reduce(lm_sq, group=mesh.pp_group)
    return vision, float(lm_sq.sqrt())


def main(layout, hf_dir, mcore_dir, rank, world, port, out_dir):
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    from areal_mega.algo import finalize_stats, make_policy_loss
    from areal_mega.config import ModelConfig, OptimizerConfig, load_config
    from areal_mega.engine.megatron_engine import MegatronEngine
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh
    from areal_mega.train import batches
    from areal_mega.train.teacher import build_teacher, opd_step

    trajs, spec = trajectories(hf_dir)
    dims = {"single": {}, "dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2)}[layout]
    mesh = ParallelMesh.create(ParallelDims(**dims), timeout_s=120)
    overrides = [
        f"rollout.n_samples={N}",
        "scheduler.max_tokens_per_mb=48",
        "algorithm.kl_coef=0.05",
        "ref.enabled=true",
        "model.dtype=fp32",
    ]
    cfg = load_config(None, overrides)
    d = mesh.dims
    plan = (
        batches.plan_step(
            trajs, cfg, dp_size=d.dp, tp_size=d.tp, pp_size=d.pp, cp_size=1, vision=spec
        )
        if mesh.rank == 0
        else None
    )
    mbs = batches.distribute(plan, mesh).micro_batches
    model_cfg = ModelConfig(path=str(hf_dir), dtype="fp32")
    actor = MegatronEngine(
        model_cfg,
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-3, clip_grad=0.0),
        seed=1,
        use_distributed_optimizer=False,
    )
    actor.load(mcore_dir)
    ref = MegatronEngine(model_cfg, role="ref", mesh=mesh, seed=1)
    ref.load(mcore_dir)
    temp = cfg.actor.temperature
    mbs = batches.attach(mbs, policy_version=[0] * len(mbs))
    mbs = batches.attach(mbs, prox_logprobs=actor.forward_logprobs(mbs, temperature=temp))
    mbs = batches.attach(mbs, ref_logprobs=ref.forward_logprobs(mbs, temperature=temp))
    # on-policy distillation's in-trainer teacher (a VL model: the same checkpoint) through
    # opd_step, which reads the session's cfg, teacher and mesh only; its advantages are not
    # trained on here
    opd_cfg = load_config(None, [*overrides, "algorithm.opd=pure", f"teacher.path={hf_dir}"])
    teacher = build_teacher(opd_cfg, mesh)
    teacher.load(mcore_dir)
    session = types.SimpleNamespace(cfg=opd_cfg, teacher=teacher, teacher_scorer=None, mesh=mesh)
    opd_mbs, opd_stats = opd_step(session, mbs)
    loss_fn, den_fn = make_policy_loss(
        cfg.algorithm, max_response_len=cfg.rollout.max_new_tokens, prox_from_forward=False
    )
    stats = actor.train_batch(mbs, loss_fn, den_fn, temperature=temp, return_entropy=True)
    merged = batches.merge_train_stats([stats], finalize_stats)
    vision, lm_norm = grad_norms(actor, mesh)
    res = {
        "prox": per_sample(mbs, [mb["prox_logprobs"] for mb in mbs]),
        "ref": per_sample(mbs, [mb["ref_logprobs"] for mb in mbs]),
        "teacher": per_sample(opd_mbs, [mb["teacher_logprobs"] for mb in opd_mbs]),
        "opd_abs_log_ratio": opd_stats["opd/abs_log_ratio"],
        "behav": per_sample(mbs, [mb["logprobs"] for mb in mbs]),
        "loss": merged["loss"],
        "grad_norm": merged["grad_norm"],
        "mismatch": merged.get("mismatch"),
        "mismatch_tokens": float(stats.get("mismatch_tokens", 0.0)),
        "vision": vision,
        "lm_grad_norm": lm_norm,
        "images": [
            [
                int(mb["image_counts"].sum()) if "image_counts" in mb else 0,
                len(mb["image_grid_thw"]) if "image_grid_thw" in mb else 0,
            ]
            for mb in mbs
        ],
    }
    mesh.destroy(process_group=True)
    with open(os.path.join(out_dir, f"{layout}.{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:8])

"""tests/test_vl_teacher.py's worker: OPD with a served vision-language teacher, one trainer
rank, through production code from the rollout to the teacher logprobs of the step.

    python -m tests.helpers.vl_teacher_worker <hf_dir> <mcore_dir> <server_addr> <out_dir>

``server_addr``: a CPU rollout server serving ``hf_dir`` (the tiny Qwen2.5-VL), which is the
rollout server and the served teacher at once. Steps:

1. rollout: a :class:`~areal_mega.rollout.controller.RolloutController` runs
   :class:`ImagePromptWorkflow` over prompts with one image, two images and none (N samples
   each): the worker decodes each prompt's images, ``encode_sample`` gives the expanded ids and
   the pixels, ``ctx.generate(ids, image_data=...)`` samples, ``ctx.trajectory(...,
   multimodal=...)`` builds the trajectory, whose ``meta["image_data"]`` SampleContext fills;
2. the trajectories go over the socket into a trainer intake with the model's VisionSpec
   (its receiver checks the images and ``meta["image_data"]``) and are journaled;
3. rank 0 plans the step (``train.batches.plan_step``), ``distribute`` hands the rank its
   micro-batches; the in-trainer teacher engine on the same checkpoint gives
   ``prox_logprobs`` (the student's, the same weights);
4. ``opd_step`` twice: with the served teacher (``build_teacher_scorer`` with the VisionSpec:
   the server's /get_model_info and image processor checked; the scorer sends each image
   sequence's ``image_data``) and with the in-trainer teacher (``teacher.path``);
5. a control: the served teacher's logprobs of the same micro-batches whose ``image_data``
   holds other pictures of the same sizes (colours inverted), which must differ;
6. one image sample's ``image_data`` taken out of the micro-batches: ``opd_step`` with the
   served teacher drops that sample (``refused/teacher``) and scores the others.

Writes ``<out_dir>/result.json``: per sample id the teacher logprobs on its loss tokens
(``served``, ``engine``), the number of images of each sample (``images``), the image_data
each micro-batch carried (``mb_image_data``: per sequence the count of strings), both
``opd/abs_log_ratio``, the intake's accepted count and the control's logprobs
(``other_images``), and the dropped sample with the stats of step 6 (``stripped``).
"""

import dataclasses
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

N = 2  # samples per prompt
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
#: per prompt: text with one placeholder per image, image sizes (width, height)
PROMPTS = [
    (f"{VISION}1+2=", [(56, 28)]),
    (f"{VISION}3*{VISION}=", [(28, 28), (28, 56)]),
    ("7-3=", []),
]
API_KEY = "test-key"


def png_url(img) -> str:
    """``img`` as a ``data:image/png;base64,`` URL (how a worker sends a prompt's images)."""
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def prompt_items() -> list:
    """The dataset: each prompt with its images as data URLs."""
    from PIL import Image

    rng = np.random.default_rng(0)
    items = []
    for k, (text, sizes) in enumerate(PROMPTS):
        imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
        items.append({"k": k, "text": text, "images": [png_url(im) for im in imgs]})
    return items


def make_workflow(hf_dir, max_new_tokens: int):
    from areal_mega.data.images import load_image
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
    from areal_mega.workflow.api import EpisodeWorkflow

    class ImagePromptWorkflow(EpisodeWorkflow):
        """One completion per sample of a prompt with images (contract C3's steps)."""

        def __init__(self):
            self.proc = load_image_processor(hf_dir)

        async def episode(self, ctx, item: dict) -> list:
            urls = item["images"]
            imgs = [
                load_image(u, base_dir=Path("/"), what="image", max_source_pixels=1 << 20)
                for u in urls
            ]
            s = encode_sample(item["text"], imgs, ctx.tokenizer, self.proc)
            ids = s.input_ids.tolist()
            gen = await ctx.generate(ids, max_new_tokens, image_data=urls or None)
            seq = ctx.new_sequence(ids)
            seq.add_generated(gen.output_ids, gen.logprobs, gen.versions, gen.routed_experts)
            mm = None
            if imgs:
                mm = {
                    "pixel_values": s.pixel_values.to(torch.float32).numpy(),
                    "image_grid_thw": s.image_grid_thw.numpy().astype(np.int32),
                }
            reward = float(ctx.sample_index % 2)
            return [
                ctx.trajectory(
                    seq, reward, len(ids), gen.finish_reason, server_id=gen.server, multimodal=mm
                )
            ]

    return ImagePromptWorkflow()


def rollout(hf_dir, addr: str) -> list:
    """Every prompt's group through the real controller against the server."""
    from transformers import AutoTokenizer

    from areal_mega.rollout.client import RolloutClient
    from areal_mega.rollout.controller import RolloutController
    from tests.helpers.rollout import GroupSink

    sink = GroupSink()
    client = RolloutClient([addr], api_key=API_KEY, timeout_s=120, retries=2)
    ctl = RolloutController(
        client,
        make_workflow(hf_dir, max_new_tokens=4),
        prompt_items(),
        batch_size=len(PROMPTS),
        n_samples=N,
        eta=1,
        sink=sink,
        tokenizer=AutoTokenizer.from_pretrained(hf_dir),
        ignore_eos=True,
    ).start()
    try:
        groups = sink.take(ctl, len(PROMPTS), timeout=240)
    finally:
        ctl.stop()
    return [t for g in groups for t in g]


def through_intake(trajs: list, spec, out_dir: Path) -> tuple:
    """The trajectories sent over the socket into a trainer intake with ``spec``: what it
    hands the step, and its accepted count."""
    from areal_mega.dataplane import TrajectorySender
    from areal_mega.train.intake import TrajectoryIntake

    intake = TrajectoryIntake(
        f"ipc://{out_dir}/intake.sock", out_dir / "run", group_size=N, vision=spec
    ).start()
    try:
        with TrajectorySender(intake.receiver.endpoint) as tx:
            for t in trajs:
                tx.send(t)
        got = intake.next_groups(len(PROMPTS), timeout=120)
        return got, intake.receiver.accepted
    finally:
        intake.close()


def inverted(mbs) -> list:
    """``mbs`` whose ``image_data`` holds each picture with its colours inverted (same sizes,
    so the same placeholder counts)."""
    from PIL import ImageOps

    from areal_mega.data.images import load_image

    def flip(url: str) -> str:
        img = load_image(url, base_dir=Path("/"), what="image", max_source_pixels=1 << 20)
        return png_url(ImageOps.invert(img))

    return [
        dataclasses.replace(mb, image_data=[[flip(u) for u in x] for x in mb.image_data])
        if mb.image_data is not None
        else mb
        for mb in mbs
    ]


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


def main(hf_dir, mcore_dir, addr, out_dir):
    from areal_mega.common.net import free_port

    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        LOCAL_RANK="0",
    )
    torch.set_num_threads(1)
    from areal_mega.config import load_config
    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.config import vision_spec
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh
    from areal_mega.train import batches
    from areal_mega.train.teacher import (
        build_teacher,
        build_teacher_scorer,
        opd_step,
        served_logprobs,
    )

    out_dir = Path(out_dir)
    spec = vision_spec(load_hf_config(hf_dir))
    trajs, accepted = through_intake(rollout(hf_dir, addr), spec, out_dir)
    mesh = ParallelMesh.create(ParallelDims(), timeout_s=120)
    common = [
        f"model.path={hf_dir}",
        f"rollout.n_samples={N}",
        "scheduler.max_tokens_per_mb=64",
        "model.dtype=fp32",
        "algorithm.opd=pure",
    ]
    engine_cfg = load_config(None, [*common, f"teacher.path={hf_dir}"])
    served_cfg = load_config(
        None, [*common, f"teacher.server_addrs=[{addr}]", f"teacher.api_key={API_KEY}"]
    )
    plan = batches.plan_step(
        trajs, engine_cfg, dp_size=1, tp_size=1, pp_size=1, cp_size=1, vision=spec
    )
    mbs = batches.distribute(plan, mesh).micro_batches
    teacher = build_teacher(engine_cfg, mesh)
    teacher.load(mcore_dir)
    # the student is the same checkpoint: its proximal logprobs are this engine's forward
    mbs = batches.attach(mbs, policy_version=[0] * len(mbs))
    mbs = batches.attach(mbs, prox_logprobs=teacher.forward_logprobs(mbs, temperature=1.0))
    in_trainer = types.SimpleNamespace(
        cfg=engine_cfg, teacher=teacher, teacher_scorer=None, mesh=mesh
    )
    engine_mbs, engine_stats = opd_step(in_trainer, mbs)
    scorer = build_teacher_scorer(served_cfg, spec)
    try:
        served = types.SimpleNamespace(
            cfg=served_cfg, teacher=None, teacher_scorer=scorer, mesh=mesh
        )
        served_mbs, served_stats = opd_step(served, mbs)
        other = served_logprobs(scorer, inverted(mbs))
        victim = next(t.sample_id for t in trajs if t.multimodal)
        stripped = [
            dataclasses.replace(
                mb,
                image_data=[
                    None if i == victim else x for i, x in zip(mb.sample_ids, mb.image_data)
                ],
            )
            if mb.image_data is not None
            else mb
            for mb in mbs
        ]
        stripped_mbs, stripped_stats = opd_step(served, stripped)
    finally:
        scorer.close()
    res = {
        "served": per_sample(served_mbs, [mb["teacher_logprobs"] for mb in served_mbs]),
        "engine": per_sample(engine_mbs, [mb["teacher_logprobs"] for mb in engine_mbs]),
        "images": {
            t.sample_id: len(t.multimodal["image_grid_thw"]) if t.multimodal else 0 for t in trajs
        },
        "image_data": {t.sample_id: t.meta.get("image_data") for t in trajs},
        "mb_image_data": [
            [len(x) for x in mb["image_data"]] if "image_data" in mb else None for mb in mbs
        ],
        "served_abs_log_ratio": served_stats["opd/abs_log_ratio"],
        "engine_abs_log_ratio": engine_stats["opd/abs_log_ratio"],
        "accepted": accepted,
        "other_images": per_sample(mbs, other),
        "stripped": {
            "victim": victim,
            "refused": stripped_stats.get("refused/teacher", 0.0),
            "teacher": per_sample(stripped_mbs, [mb["teacher_logprobs"] for mb in stripped_mbs]),
        },
    }
    mesh.destroy(process_group=True)
    (out_dir / "result.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:5])

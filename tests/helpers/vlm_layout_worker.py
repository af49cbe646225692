"""One rank of tests/test_vlm.py's 2-rank layouts of the engine's Qwen2.5-VL against its single
rank (tests/helpers/vlm_worker.py's ``layout_ref.pt``: the same two micro-batches).

    python -m tests.helpers.vlm_layout_worker <layout> <hf_dir> <mcore_dir> <ref.pt> <rank> \\
        <world> <port> <out_dir>

``dp2``: rank r takes micro-batch r; ``tp2``, ``tp2sp`` (with sequence parallelism: the
micro-batches padded to an even length), ``pp2``, ``pp2vpp2`` (two virtual stages per rank: a
model of 4 layers): both ranks take both. ``single`` (world 1) writes the single-rank reference
``<ref.pt>`` of a model other than tests/helpers/vlm_worker.py's (its ``layout_ref.pt``). Writes
``<out_dir>/<layout>.<rank>.json``: the largest |layout - single rank| of the packed logprobs
(``logprobs``), of the vision tower's gradients (``vision_grads``, full tensors on every rank
that has the tower, ``has_vision``: not PP2's second stage; reduced over DP and averaged over
TP as the engine finalises them), and the differences of the
language model's gradient norm (``lm_grad_norm``, relative) and of the loss (``loss``).
"""

import json
import os
import sys

import numpy as np
import torch


def pad_to_even(mb: dict) -> dict:
    """``mb`` with one trailing pad token (label -1, no loss) when its length is odd."""
    if len(mb["input_ids"]) % 2 == 0:
        return mb
    one = dict(input_ids=0, labels=-1, loss_mask=0)
    return dict(
        mb, **{k: torch.cat([mb[k], torch.tensor([v], dtype=mb[k].dtype)]) for k, v in one.items()}
    )


def main(layout, hf_dir, mcore_dir, ref_path, rank, world, port, out_dir):
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh
    from tests.helpers.vlm_worker import SAMPLES, engine_micro_batch, images, layout_pass

    tok = AutoTokenizer.from_pretrained(hf_dir)
    proc = load_image_processor(hf_dir)
    rng = np.random.default_rng(0)
    samples = [encode_sample(t, images(rng, s), tok, proc) for t, s in SAMPLES]
    mbs = [engine_micro_batch(samples[:2]), engine_micro_batch(samples[2:])]
    dims = {
        "single": {},
        "dp2": dict(dp=2),
        "tp2": dict(tp=2),
        "tp2sp": dict(tp=2),
        "pp2": dict(pp=2),
        "pp2vpp2": dict(pp=2),
    }
    sp = layout == "tp2sp"
    mesh = ParallelMesh.create(
        ParallelDims(**dims[layout]),
        vpp=2 if layout == "pp2vpp2" else None,
        sequence_parallel=sp,
        timeout_s=90,
    )
    if layout == "single":
        torch.save(layout_pass(hf_dir, mcore_dir, mesh, mbs), ref_path)
        mesh.destroy(process_group=True)
        return
    mine = [int(rank)] if layout == "dp2" else [0, 1]
    if sp:  # the packed length a multiple of TP: trailing padding (no loss tokens)
        mbs = [pad_to_even(mb) for mb in mbs]
    got = layout_pass(hf_dir, mcore_dir, mesh, [mbs[i] for i in mine])
    ref = torch.load(ref_path)
    res = {
        "logprobs": max(
            (a[: len(ref["lps"][i])] - ref["lps"][i]).abs().max().item()
            for a, i in zip(got["lps"], mine)
        ),
        # the vision tower lives on the first pipeline stage only
        "vision_grads": max(
            (got["vision"][n] - g).abs().max().item() for n, g in ref["vision"].items()
        )
        if got["vision"]
        else None,
        "has_vision": bool(got["vision"]),
        "vision_grad_scale": max(g.abs().max().item() for g in ref["vision"].values()),
        "lm_grad_norm": abs(got["lm_grad_norm"] - ref["lm_grad_norm"]) / ref["lm_grad_norm"],
        "loss": abs(got["loss"] - ref["loss"]),
    }
    mesh.destroy(process_group=True)
    with open(os.path.join(out_dir, f"{layout}.{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:9])

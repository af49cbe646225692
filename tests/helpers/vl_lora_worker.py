"""One process of tests/test_vl_lora.py: LoRA on the tiny Qwen3-VL through production code.

    python -m tests.helpers.vl_lora_worker <hf_dir> <mcore_dir> <out_dir>
    python -m tests.helpers.vl_lora_worker <dp2|tp2> <hf_dir> <mcore_dir> <ref_dir> <rank> \
        <world> <port> <out_dir>

A LoRA actor (rank 4, every attention and MLP projection) loads its base from the converted
checkpoint (``base_keys``), takes two SFT steps on a packed micro-batch with images, publishes
its adapters as a PEFT directory (``publish_adapter``) and is compared with transformers'
Qwen3-VL: with the adapters off (``AdaptersOffReference``) against the base model, with them
against ``peft.PeftModel.from_pretrained`` of the published directory. Writes
``<out_dir>/res.json``: ``trainable`` (the projections with trainable parameters: adapters
only), ``trainable_outside_language_model``, ``losses``, ``moved_base`` (non-adapter parameters
that moved: none), ``adapters_moved``, ``adapters_off_vs_base``, ``ours_in_peft``,
``adapters_change_output``, ``peft_modules`` (transformers' modules PEFT adapted: the language
model's only). It also writes the single-rank reference of the 2-rank layouts
(``<out_dir>/init``: random adapters as a PEFT directory; ``ref.pt``: logprobs, loss and the
adapters' gradients of one forward-backward on two micro-batches), which ``layout_main``
compares with DP2 and TP2.
"""

import json
import os
import sys

import numpy as np
import torch


def hf_logprobs(model, samples):
    """Per sample, transformers' logprobs of the next tokens (images with their token types)."""
    out = []
    for s in samples:
        kw = {}
        if s.pixel_values is not None:
            kw = dict(
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
                mm_token_type_ids=s.mm_token_type_ids[None],
            )
        with torch.no_grad():
            r = model(input_ids=s.input_ids[None], **kw).logits[0]
        out.append(torch.log_softmax(r, -1)[:-1].gather(1, s.input_ids[1:, None])[:, 0])
    return out


def main(hf_dir, mcore_dir, out_dir):
    from peft import PeftModel
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.engine import default_denominator
    from areal_mega.lora.actor import AdaptersOffReference, publish_adapter
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
    from areal_mega.train.sft import sft_loss
    from tests.helpers.vlm_worker import SAMPLES, engine_micro_batch, images

    res = {}
    tok = AutoTokenizer.from_pretrained(hf_dir)
    proc = load_image_processor(hf_dir)
    rng = np.random.default_rng(0)
    samples = [encode_sample(t, images(rng, s), tok, proc) for t, s in SAMPLES]
    mb = engine_micro_batch(samples)
    cu = mb["cu_seqlens"]
    mesh = _single_process_mesh()
    eng = lora_engine(hf_dir, mcore_dir, mesh)
    (model,) = eng.model_chunks()
    named = dict(model.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    res["trainable"] = sorted({n.split(".adapter.")[0].rsplit(".", 1)[-1] for n in trainable})
    res["trainable_outside_adapters"] = [n for n in trainable if ".adapter." not in n]
    res["trainable_outside_language_model"] = [
        n for n in trainable if not n.startswith("language_model.")
    ]
    before = {n: p.detach().clone() for n, p in named.items()}
    res["losses"] = [
        float(eng.train_batch([mb], sft_loss, default_denominator)["loss"]) for _ in range(2)
    ]
    moved = {n for n, p in model.named_parameters() if not p.detach().equal(before[n])}
    res["moved_base"] = sorted(n for n in moved if ".adapter." not in n)
    res["adapters_moved"] = len([n for n in moved if ".adapter." in n])
    (lp,) = eng.forward_logprobs([mb])
    (off,) = AdaptersOffReference(eng).forward_logprobs([mb])
    adapter = os.path.join(out_dir, "adapter")
    publish_adapter(eng, adapter, base_model=str(hf_dir), is_writer=True)

    def worst(packed, refs):
        return max(
            (packed[int(cu[i]) : int(cu[i + 1]) - 1] - r).abs().max().item()
            for i, r in enumerate(refs)
        )

    ref = Qwen3VLForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    base = hf_logprobs(ref, samples)
    res["adapters_off_vs_base"] = worst(off, base)
    res["adapters_change_output"] = worst(lp, base)
    peft = PeftModel.from_pretrained(ref, adapter).eval()
    res["ours_in_peft"] = worst(lp, hf_logprobs(peft, samples))
    res["peft_modules"] = sorted(
        {n.split(".layers.")[0] for n, _ in peft.named_modules() if n.endswith(".lora_A")}
    )
    # the single-rank reference of layout_main: random adapters (a PEFT directory both load),
    # one forward-backward on the two micro-batches
    eng = lora_engine(hf_dir, mcore_dir, mesh)
    g = torch.Generator().manual_seed(3)
    for n, p in sorted(eng.model_chunks()[0].named_parameters()):
        if ".adapter." in n:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    publish_adapter(eng, os.path.join(out_dir, "init"), base_model=str(hf_dir), is_writer=True)
    torch.save(layout_pass(eng, layout_micro_batches(hf_dir)), os.path.join(out_dir, "ref.pt"))
    mesh.destroy(process_group=True)
    with open(os.path.join(out_dir, "res.json"), "w") as f:
        json.dump(res, f)


def lora_engine(hf_dir, mcore_dir, mesh):
    """A LoRA actor (rank 4, every projection) on ``mesh`` with its base from ``mcore_dir``."""
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.config import LoraConfig, ModelConfig, OptimizerConfig
    from areal_mega.engine.megatron_engine import MegatronEngine
    from areal_mega.lora.actor import base_keys

    eng = MegatronEngine(
        ModelConfig(path=str(hf_dir), dtype="fp32"),
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-2, clip_grad=0.0),
        seed=1,
        use_distributed_optimizer=False,
        lora=LoraConfig(enabled=True, rank=4, alpha=8.0),
    )
    load_checkpoint(
        mcore_dir, eng.model_chunks(), load_optimizer=False, load_rng=False, model_keys=base_keys
    )
    return eng


def layout_micro_batches(hf_dir):
    """Two micro-batches of the samples (images in the first, one in the second)."""
    from transformers import AutoTokenizer

    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
    from tests.helpers.vlm_worker import SAMPLES, engine_micro_batch, images

    tok = AutoTokenizer.from_pretrained(hf_dir)
    proc = load_image_processor(hf_dir)
    rng = np.random.default_rng(0)
    samples = [encode_sample(t, images(rng, s), tok, proc) for t, s in SAMPLES]
    return [engine_micro_batch(samples[:2]), engine_micro_batch(samples[2:])]


def layout_pass(eng, mbs) -> dict:
    """Logprobs, the SFT loss of one forward-backward and the adapters' gradients under their
    PEFT names (TP shards gathered)."""
    from areal_mega.engine import default_denominator
    from areal_mega.lora.peft_io import iter_peft_tensors
    from areal_mega.train.sft import sft_loss

    lps = eng.forward_logprobs(mbs)
    stats = eng.forward_backward(mbs, sft_loss, default_denominator)
    grads = dict(iter_peft_tensors(eng.model, eng.arch, rank=eng.lora.rank, grads=True))
    return dict(lps=lps, loss=float(stats["loss"]), grads=grads)


def layout_main(layout, hf_dir, mcore_dir, ref_dir, rank, world, port, out_dir):
    """One rank of a 2-rank layout (``dp2``: micro-batch r; ``tp2``: both) against the single
    rank: the largest differences of the logprobs, the loss and the adapters' gradients."""
    import torch.distributed as dist

    from areal_mega.lora.peft_io import load_peft_adapter
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh

    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    dims = {"dp2": dict(dp=2), "tp2": dict(tp=2)}[layout]
    mesh = ParallelMesh.create(ParallelDims(**dims), timeout_s=90)
    eng = lora_engine(hf_dir, mcore_dir, mesh)
    load_peft_adapter(
        eng.model,
        eng.arch,
        os.path.join(ref_dir, "init"),
        rank=4,
        tp_rank=mesh.tp_rank,
        tp=mesh.dims.tp,
    )
    mbs = layout_micro_batches(hf_dir)
    mine = [int(rank)] if layout == "dp2" else [0, 1]
    got = layout_pass(eng, [mbs[i] for i in mine])
    ref = torch.load(os.path.join(ref_dir, "ref.pt"))
    res = {
        "logprobs": max(
            (a[: len(ref["lps"][i])] - ref["lps"][i]).abs().max().item()
            for a, i in zip(got["lps"], mine)
        ),
        "loss": abs(got["loss"] - ref["loss"]),
        "grads": max((got["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items()),
        "grad_scale": max(g.abs().max().item() for g in ref["grads"].values()),
        "same_names": sorted(got["grads"]) == sorted(ref["grads"]),
    }
    dist.barrier()
    mesh.destroy(process_group=True)
    with open(os.path.join(out_dir, f"{layout}.{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    if sys.argv[1] in ("dp2", "tp2"):
        layout_main(*sys.argv[1:9])
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3])

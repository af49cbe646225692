"""One process of tests/test_vlm.py: the tiny Qwen2.5-VL built by the engine from the bridge's
provider (areal_mega/models/vlm), against transformers.

    python -m tests.helpers.vlm_worker <hf_dir> <mcore_dir> <out.json>

(``<mcore_dir>``: the tiny model converted by tools/convert_hf_to_mcore.py.)

Writes ``{check: value}``:

* ``hf_logits``: per sample, the largest |engine - transformers| logit of one packed (THD)
  micro-batch of several samples, each with its own images (one with two, one with none),
  against transformers' model on the sample alone (eager attention, fp32);
* ``hf_logprobs``: the same for the packed per-token logprobs of the next tokens
  (:func:`areal_mega.ops.packed_logprobs`);
* ``text_positions_diff``: per image sample, the engine's logits against transformers' with
  text positions for the image tokens (the multimodal RoPE bites: far above the tolerance);
* ``image_tokens``: image placeholder tokens per sample (every image sample has some);
* ``roundtrip_max_diff`` / ``roundtrip_same_names``: the checkpoint loaded into the model and
  written back as HF tensors, against the checkpoint (bit-exact: 0.0, True);
* ``mrope_section``: the built language model's sections;
* ``frozen`` / ``trainable_vision``: with ``freeze_vision``, the parameters that do not train,
  and the vision ones that do and got a gradient from a backward pass;
* ``engine_logprobs``: per sample, the largest |engine - transformers| packed logprob of
  ``MegatronEngine.forward_logprobs`` (a reference engine on the converted checkpoint, the
  micro-batch in next-token layout with its images);
* ``engine_trailing_padding``: the same micro-batch with trailing pad tokens (one more packed
  "sequence"), its logprobs against the unpadded ones (``engine_padding_logprobs``: the pads',
  0);
* ``train_*``: an actor engine with ``model.freeze_vision`` after one SFT ``train_batch`` on
  that micro-batch: the loss, which parameters moved (``train_moved`` prefixes) and which did
  not (``train_frozen_moved``: the frozen tower's that moved, none).

It also writes ``<out.json>.layout_ref.pt``, the single-rank reference of
tests/helpers/vlm_layout_worker.py (:func:`layout_pass` on two micro-batches).
"""

import json
import sys

import numpy as np
import torch


def images(rng, sizes):
    from PIL import Image

    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


#: (text with one <|image_pad|> per image, image sizes (height, width))
SAMPLES = [
    ("<|vision_start|><|image_pad|><|vision_end|>12+3=15", [(56, 28)]),
    (
        "1<|vision_start|><|image_pad|><|vision_end|>2*<|vision_start|><|image_pad|>"
        "<|vision_end|>=4:9",
        [(28, 28), (56, 56)],
    ),
    ("7-3=4, 9", []),
    ("<|vision_start|><|image_pad|><|vision_end|>?", [(56, 56)]),
]


#: the vision tower's parameter names: transformers' modules (Qwen2.5-VL) or megatron's
#: (Qwen3-VL)
VISION_PREFIXES = ("visual.", "vision_model.")
#: the parameters model.freeze_vision freezes (the tower without its projector)
FROZEN_TOWER = ("visual.patch_embed.", "visual.blocks.")


def engine_micro_batch(samples) -> dict:
    """The engine's micro-batch of ``samples``: packed tokens, next-token labels, every label a
    loss token, the samples' images in packed order."""
    from areal_mega.models.vlm.inputs import pack_samples
    from areal_mega.train.batches import next_token_layout

    mb = pack_samples(samples)
    labels = torch.as_tensor(
        np.concatenate([next_token_layout(s.input_ids.numpy())["labels"] for s in samples])
    )
    return dict(
        input_ids=mb["input_ids"][0],
        labels=labels,
        loss_mask=(labels >= 0).to(torch.uint8),
        cu_seqlens=mb["cu_seqlens"],
        pixel_values=mb["pixel_values"],
        image_grid_thw=mb["image_grid_thw"],
    )


def layout_pass(hf_dir, mcore_dir, mesh, mbs) -> dict:
    """An actor (every parameter trains) on the converted checkpoint: ``forward_logprobs`` of
    ``mbs`` and one ``forward_backward`` with the SFT loss; the loss, the vision tower's
    gradients (replicated on every rank: full tensors) and the language model's gradient norm
    (its TP shards' squares summed over the TP group)."""
    import torch.distributed as dist

    from areal_mega.config import ModelConfig, OptimizerConfig
    from areal_mega.engine import default_denominator
    from areal_mega.engine.megatron_engine import MegatronEngine
    from areal_mega.train.sft import sft_loss

    eng = MegatronEngine(
        ModelConfig(path=str(hf_dir), dtype="fp32"),
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-3, clip_grad=0.0),
        seed=1,
        use_distributed_optimizer=False,
    )
    eng.load(mcore_dir)
    lps = eng.forward_logprobs(mbs)
    stats = eng.forward_backward(mbs, sft_loss, default_denominator)
    vision, lm_sq = {}, torch.zeros((), dtype=torch.float64)
    for chunk in eng.model:  # virtual pipeline stages: several chunks per rank
        inner = chunk.module
        # the last stage's copy of the tied embedding (the first stage's counts)
        tied_copy = not inner.pre_process and inner.share_embeddings_and_output_weights
        for n, p in inner.named_parameters():
            g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            if n.startswith(VISION_PREFIXES):
                g = g.detach().float()
                if getattr(p, "tensor_model_parallel", False) and mesh.dims.tp > 1:
                    # a tower of megatron layers (Qwen3-VL) is tensor-parallel: the full gradient
                    parts = [torch.empty_like(g) for _ in range(mesh.dims.tp)]
                    dist.all_gather(parts, g.contiguous(), group=mesh.tp_group)
                    g = torch.cat(parts, dim=p.partition_dim)
                vision[n] = g.clone()
            elif tied_copy and n.endswith("output_layer.weight"):
                continue
            elif getattr(p, "tensor_model_parallel", False) or mesh.tp_rank == 0:
                lm_sq += g.detach().double().pow(2).sum()
    if mesh.dims.tp > 1:
        dist.all_reduce(lm_sq, group=mesh.tp_group)
    if mesh.dims.pp > 1:
        dist.all_reduce(lm_sq, group=mesh.pp_group)
    return dict(loss=float(stats["loss"]), lps=lps, vision=vision, lm_grad_norm=float(lm_sq.sqrt()))


def engine_checks(res, hf_dir, mcore_dir, mesh, samples, ref_lps, frozen_tower=FROZEN_TOWER):
    """The engine on the converted checkpoint: reference logprobs, one actor SFT step
    (``frozen_tower``: the parameter names ``model.freeze_vision`` freezes)."""
    from areal_mega.config import ModelConfig, OptimizerConfig
    from areal_mega.engine import default_denominator
    from areal_mega.engine.megatron_engine import MegatronEngine
    from areal_mega.train.sft import sft_loss

    mb = engine_micro_batch(samples)
    cu = mb["cu_seqlens"]
    ref = MegatronEngine(ModelConfig(path=str(hf_dir), dtype="fp32"), role="ref", mesh=mesh, seed=1)
    ref.load(mcore_dir)
    (lp,) = ref.forward_logprobs([mb])
    res["engine_logprobs"] = [
        (lp[int(cu[i]) : int(cu[i + 1]) - 1] - r).abs().max().item() for i, r in enumerate(ref_lps)
    ]
    # trailing padding (the packer's pad_to_multiple): one more packed "sequence" of pad tokens
    pad = 5
    padded = dict(
        mb,
        input_ids=torch.cat([mb["input_ids"], torch.zeros(pad, dtype=mb["input_ids"].dtype)]),
        labels=torch.cat([mb["labels"], torch.full((pad,), -1, dtype=mb["labels"].dtype)]),
    )
    (lp_pad,) = ref.forward_logprobs([padded])
    res["engine_trailing_padding"] = (lp_pad[: len(lp)] - lp).abs().max().item()
    res["engine_padding_logprobs"] = lp_pad[len(lp) :].abs().max().item()
    actor = MegatronEngine(
        ModelConfig(path=str(hf_dir), dtype="fp32", freeze_vision=True),
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-2, clip_grad=0.0),
        seed=1,
    )
    actor.load(mcore_dir)
    (model,) = actor.model_chunks()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = actor.train_batch([mb], sft_loss, default_denominator)
    res["train_loss"] = float(stats["loss"])
    moved = {n for n, p in model.named_parameters() if not p.detach().equal(before[n])}
    res["train_moved"] = sorted({".".join(n.split(".")[:2]) for n in moved})
    res["train_frozen_moved"] = sorted(n for n in moved if n.startswith(frozen_tower))


def main(hf_dir, mcore_dir, out_path):
    from megatron.core.packed_seq_params import PackedSeqParams
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.checkpoint.safetensors_io import SafetensorsDir
    from areal_mega.checkpoint.vl_mapping import load_hf_weights, to_hf_state_dict
    from areal_mega.engine.packed_params import packed_seq_kwargs
    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.builder import build_vl_model_chunks
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor, pack_samples
    from areal_mega.ops import packed_logprobs

    res = {}
    tok = AutoTokenizer.from_pretrained(hf_dir)
    proc = load_image_processor(hf_dir)
    rng = np.random.default_rng(0)
    samples = [encode_sample(t, images(rng, s), tok, proc) for t, s in SAMPLES]
    res["image_tokens"] = [int(s.mm_token_type_ids.sum()) for s in samples]

    hf = load_hf_config(hf_dir)
    mesh = _single_process_mesh()
    (model,), config = build_vl_model_chunks(hf, mesh, dtype="fp32", use_te=False)
    res["mrope_section"] = list(config.mrope_section)
    load_hf_weights(model, SafetensorsDir(hf_dir))
    ckpt = load_file(f"{hf_dir}/model.safetensors")
    back = to_hf_state_dict(model, hf["text_config"]["vocab_size"])
    res["roundtrip_same_names"] = set(back) == set(ckpt)
    res["roundtrip_max_diff"] = max(
        (back[k] - ckpt[k]).abs().max().item() if back[k].shape == ckpt[k].shape else float("inf")
        for k in ckpt
    )

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = hf["text_config"]["vocab_size"]
    mb = pack_samples(samples)
    cu = mb["cu_seqlens"]
    total = mb["input_ids"].shape[1]
    psp = PackedSeqParams(**packed_seq_kwargs(cu, None, total))
    model.eval()
    with torch.no_grad():
        logits = model(
            input_ids=mb["input_ids"],
            position_ids=None,
            attention_mask=None,
            pixel_values=mb["pixel_values"],
            image_grid_thw=mb["image_grid_thw"],
            packed_seq_params=psp,
        )[0, :, :vocab]
        labels = torch.full((total,), -1, dtype=torch.long)
        ids = mb["input_ids"][0]
        for i in range(len(samples)):
            labels[cu[i] : cu[i + 1] - 1] = ids[cu[i] + 1 : cu[i + 1]]
        lp = packed_logprobs(logits, labels)
        res["hf_logits"], res["hf_logprobs"] = [], []
        ref_lps = []
        for i, s in enumerate(samples):
            kw = {}
            if s.pixel_values is not None:
                kw = dict(
                    pixel_values=s.pixel_values,
                    image_grid_thw=s.image_grid_thw,
                    mm_token_type_ids=s.mm_token_type_ids[None],
                )
            r = ref(input_ids=s.input_ids[None], **kw).logits[0]
            a, b = int(cu[i]), int(cu[i + 1])
            res["hf_logits"].append((logits[a:b] - r).abs().max().item())
            r_lp = torch.log_softmax(r, -1)[:-1].gather(1, s.input_ids[1:, None])[:, 0]
            ref_lps.append(r_lp)
            res["hf_logprobs"].append((lp[a : b - 1] - r_lp).abs().max().item())
            if kw:  # transformers without mm_token_type_ids: text positions for image tokens
                del kw["mm_token_type_ids"]
                r_text = ref(input_ids=s.input_ids[None], **kw).logits[0]
                res.setdefault("text_positions_diff", []).append(
                    (logits[a:b] - r_text).abs().max().item()
                )

    (model,), _ = build_vl_model_chunks(hf, mesh, dtype="fp32", use_te=False, freeze_vision=True)
    load_hf_weights(model, SafetensorsDir(hf_dir))
    model.train()
    out = model(
        input_ids=mb["input_ids"],
        position_ids=None,
        attention_mask=None,
        pixel_values=mb["pixel_values"],
        image_grid_thw=mb["image_grid_thw"],
        packed_seq_params=psp,
    )
    out[0, :, :vocab].logsumexp(-1).sum().backward()
    named = dict(model.named_parameters())
    res["frozen"] = sorted(n for n, p in named.items() if not p.requires_grad)
    res["trainable_vision"] = sorted(
        n for n, p in named.items() if n.startswith("visual.") and p.requires_grad
    )
    res["trainable_without_grad"] = sorted(
        n for n, p in named.items() if p.requires_grad and p.grad is None
    )
    engine_checks(res, hf_dir, mcore_dir, mesh, samples, ref_lps)
    # the single-rank reference of tests/helpers/vlm_layout_worker.py: two micro-batches
    mbs = [engine_micro_batch(samples[:2]), engine_micro_batch(samples[2:])]
    torch.save(layout_pass(hf_dir, mcore_dir, mesh, mbs), out_path + ".layout_ref.pt")
    mesh.destroy(process_group=True)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])

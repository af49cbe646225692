"""One process of tests/test_qwen3_vl.py: the tiny Qwen3-VL built by the engine from the
bridge's provider and model classes (areal_mega/models/vlm/qwen3_vl.py), against transformers.

    python -m tests.helpers.qwen3_vl_worker <hf_dir> <mcore_dir> <out.json>

Writes what tests/helpers/vlm_worker.py writes for Qwen2.5-VL (the same samples: the tiny
Qwen3-VL's processor resizes them to 32 / 64 pixels, the same merged-patch counts):
``hf_logits`` / ``hf_logprobs`` (one packed micro-batch against transformers' model on each
sample alone), ``text_positions_diff``, ``image_tokens``, ``roundtrip_*``, ``mrope_section``,
``frozen`` / ``trainable_vision`` / ``trainable_without_grad`` (with ``freeze_vision``), the
engine's ``engine_*`` and ``train_*`` checks, and also ``no_deepstack_diff``: the logits with
the deepstack features left out (they bite: far above the tolerance) and ``exact_gelu_diff``:
with the bridge's own tanh-approximated GELU in the patch mergers (it differs from
transformers'). It writes ``<out.json>.layout_ref.pt``, the single-rank reference of
tests/helpers/vlm_layout_worker.py.
"""

import json
import sys

import numpy as np
import torch

#: the parameters model.freeze_vision freezes: the tower's patch embedding, position
#: embedding and blocks (its mergers, the deepstack ones included, train)
FROZEN_TOWER = (
    "vision_model.patch_embed.",
    "vision_model.pos_embed.",
    "vision_model.decoder.layers.",
)


def main(hf_dir, mcore_dir, out_path):
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.checkpoint.safetensors_io import SafetensorsDir
    from areal_mega.checkpoint.vl_mapping import load_hf_weights, to_hf_state_dict
    from areal_mega.engine.packed_params import packed_seq_kwargs
    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.builder import build_vl_model_chunks
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor, pack_samples
    from areal_mega.models.vlm.qwen3_vl import merger_modules
    from areal_mega.ops import packed_logprobs
    from tests.helpers.vlm_worker import (
        SAMPLES,
        engine_checks,
        engine_micro_batch,
        images,
        layout_pass,
    )

    res = {}
    tok = AutoTokenizer.from_pretrained(hf_dir)
    proc = load_image_processor(hf_dir)
    rng = np.random.default_rng(0)
    samples = [encode_sample(t, images(rng, s), tok, proc) for t, s in SAMPLES]
    res["image_tokens"] = [int(s.mm_token_type_ids.sum()) for s in samples]
    res["grids"] = [s.image_grid_thw.tolist() for s in samples if s.image_grid_thw is not None]

    hf = load_hf_config(hf_dir)
    mesh = _single_process_mesh()
    (model,), config = build_vl_model_chunks(hf, mesh, dtype="fp32", use_te=False)
    res["model_class"] = type(model).__name__
    res["mrope_section"] = list(config.mrope_section)
    load_hf_weights(model, SafetensorsDir(hf_dir), model_type="qwen3_vl")
    ckpt = load_file(f"{hf_dir}/model.safetensors")
    back = to_hf_state_dict(model, hf["text_config"]["vocab_size"], model_type="qwen3_vl")
    res["roundtrip_same_names"] = set(back) == set(ckpt)
    res["roundtrip_max_diff"] = max(
        (back[k] - ckpt[k]).abs().max().item() if back[k].shape == ckpt[k].shape else float("inf")
        for k in ckpt
    )

    ref = Qwen3VLForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = hf["text_config"]["vocab_size"]
    mb = pack_samples(samples)
    cu = mb["cu_seqlens"]
    total = mb["input_ids"].shape[1]
    psp = PackedSeqParams(**packed_seq_kwargs(cu, None, total))
    ids = mb["input_ids"][0]
    labels = torch.full((total,), -1, dtype=torch.long)
    for i in range(len(samples)):
        labels[cu[i] : cu[i + 1] - 1] = ids[cu[i] + 1 : cu[i + 1]]
    model.eval()

    def forward():
        return model(
            input_ids=mb["input_ids"],
            position_ids=None,
            attention_mask=None,
            pixel_values=mb["pixel_values"],
            image_grid_thw=mb["image_grid_thw"],
            packed_seq_params=psp,
        )[0, :, :vocab]

    with torch.no_grad():
        logits = forward()
        lp = packed_logprobs(logits, labels)
        res["hf_logits"], res["hf_logprobs"] = [], []
        ref_lps, ref_logits = [], []
        for i, s in enumerate(samples):
            kw = {}
            if s.pixel_values is not None:
                kw = dict(
                    pixel_values=s.pixel_values,
                    image_grid_thw=s.image_grid_thw,
                    mm_token_type_ids=s.mm_token_type_ids[None],
                )
            r = ref(input_ids=s.input_ids[None], **kw).logits[0]
            ref_logits.append(r)
            a, b = int(cu[i]), int(cu[i + 1])
            res["hf_logits"].append((logits[a:b] - r).abs().max().item())
            r_lp = torch.log_softmax(r, -1)[:-1].gather(1, s.input_ids[1:, None])[:, 0]
            ref_lps.append(r_lp)
            res["hf_logprobs"].append((lp[a : b - 1] - r_lp).abs().max().item())
            if kw:  # every token typed as text: text positions for the image tokens
                kw["mm_token_type_ids"] = torch.zeros_like(kw["mm_token_type_ids"])
                r_text = ref(input_ids=s.input_ids[None], **kw).logits[0]
                res.setdefault("text_positions_diff", []).append(
                    (logits[a:b] - r_text).abs().max().item()
                )

        def worst(other):
            return max(
                (other[int(cu[i]) : int(cu[i + 1])] - r).abs().max().item()
                for i, r in enumerate(ref_logits)
            )

        # the deepstack features bite: the language model without them is far off
        lm = model.language_model
        plain = lm.forward

        def without_deepstack(*a, **kw):
            kw.update(visual_pos_masks=None, deepstack_visual_embeds=None)
            return plain(*a, **kw)

        lm.forward = without_deepstack
        res["no_deepstack_diff"] = worst(forward())
        lm.forward = plain
        # the bridge's mergers' own activation (tanh-approximated GELU) against transformers'
        bridge_activation = model.vision_model.config.activation_func  # the mergers' upstream
        for m in merger_modules(model.vision_model):
            m.activation_func = bridge_activation
        res["exact_gelu_diff"] = worst(forward())
        res["bridge_merger_activation_is_exact_gelu"] = bridge_activation is F.gelu
        for m in merger_modules(model.vision_model):
            m.activation_func = F.gelu
        res["restored_diff"] = worst(forward())

    (model,), _ = build_vl_model_chunks(hf, mesh, dtype="fp32", use_te=False, freeze_vision=True)
    load_hf_weights(model, SafetensorsDir(hf_dir), model_type="qwen3_vl")
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
        n for n, p in named.items() if n.startswith("vision_model.") and p.requires_grad
    )
    res["trainable_without_grad"] = sorted(
        n for n, p in named.items() if p.requires_grad and p.grad is None
    )
    engine_checks(res, hf_dir, mcore_dir, mesh, samples, ref_lps, frozen_tower=FROZEN_TOWER)
    mbs = [engine_micro_batch(samples[:2]), engine_micro_batch(samples[2:])]
    torch.save(layout_pass(hf_dir, mcore_dir, mesh, mbs), out_path + ".layout_ref.pt")
    mesh.destroy(process_group=True)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])

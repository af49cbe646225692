"""One rank of tests/test_vlm.py's tensor-parallel check: the tiny Qwen2.5-VL built at TP2 by
the engine (areal_mega/models/vlm), its converted checkpoint loaded (resharded by megatron's
dist_checkpointing), one packed micro-batch of tests/helpers/vlm_worker.py's samples.

    python -m tests.helpers.vlm_tp_worker <hf_dir> <mcore_dir> <rank> <world> <port> <out_dir>

Writes ``<out_dir>/tp2.<rank>.json``: ``hf_logits`` / ``hf_logprobs`` per sample, the largest
|engine - transformers| of the TP-gathered logits and of the packed logprobs (computed over the
vocabulary shards with the TP group), as tests/helpers/vlm_worker.py does at one rank.
"""

import json
import os
import sys

import numpy as np
import torch


def main(hf_dir, mcore_dir, rank, world, port, out_dir):
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.engine.packed_params import packed_seq_kwargs
    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.builder import build_vl_model_chunks
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor, pack_samples
    from areal_mega.ops import packed_logprobs
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh
    from tests.helpers.vlm_worker import SAMPLES, images

    res = {}
    tok = AutoTokenizer.from_pretrained(hf_dir)
    proc = load_image_processor(hf_dir)
    rng = np.random.default_rng(0)
    samples = [encode_sample(t, images(rng, s), tok, proc) for t, s in SAMPLES]
    hf = load_hf_config(hf_dir)
    vocab = hf["text_config"]["vocab_size"]
    mesh = ParallelMesh.create(ParallelDims(tp=int(world)), timeout_s=90)
    (model,), _ = build_vl_model_chunks(hf, mesh, dtype="fp32", use_te=False)
    load_checkpoint(mcore_dir, [model], load_optimizer=False, load_rng=False)
    mb = pack_samples(samples)
    cu = mb["cu_seqlens"]
    total = mb["input_ids"].shape[1]
    model.eval()
    with torch.no_grad():
        local = model(
            input_ids=mb["input_ids"],
            position_ids=None,
            attention_mask=None,
            pixel_values=mb["pixel_values"],
            image_grid_thw=mb["image_grid_thw"],
            packed_seq_params=PackedSeqParams(**packed_seq_kwargs(cu, None, total)),
        )[0]
        logits = gather_from_tensor_model_parallel_region(local)[:, :vocab]
        labels = torch.full((total,), -1, dtype=torch.long)
        ids = mb["input_ids"][0]
        for i in range(len(samples)):
            labels[cu[i] : cu[i + 1] - 1] = ids[cu[i] + 1 : cu[i + 1]]
        # the padded vocabulary rows are zero and the tiny vocabulary sits in rank 0's shard
        v_local = local.shape[-1]
        keep = torch.arange(v_local) + mesh.tp_rank * v_local < vocab
        masked = local.masked_fill(~keep, -1e9)
        lp = packed_logprobs(masked, labels, tp_group=mesh.tp_group)
        ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        res["hf_logits"], res["hf_logprobs"] = [], []
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
            res["hf_logprobs"].append((lp[a : b - 1] - r_lp).abs().max().item())
    res["tp_local_vocab"] = int(local.shape[-1])
    mesh.destroy(process_group=True)
    with open(os.path.join(out_dir, f"tp2.{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:7])

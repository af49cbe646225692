"""Single-rank check of the packed (varlen) CPU attention against the dense-mask path, run by
tests/test_varlen_attention.py in its own process (megatron's parallel state is global).

    python -m tests.helpers.varlen_worker <port> <out.json>

The reference is the engine's model called with megatron's dense block-diagonal ``[T, T]``
mask (tests/helpers/engine_worker.py ``reference``); the engine under test runs the same weights
with THD ``PackedSeqParams`` through :class:`~areal_mega.models.varlen_attention.
VarlenDotProductAttention`. Both layouts the engine packs on CPU are covered: contiguous
sequences with trailing padding, and slots padded per sequence (``cu_seqlens_padded``, the
context-parallel packing). The policy loss trains on logits of its loss-mask rows only
(engine/loss_rows.py), against the reference's full logits. Writes {check: max abs
difference}."""

import os
import sys
import traceback

import torch

from tests.helpers import engine_worker as ew
from tests.helpers import group_batches

# grouped-query attention (4 query heads, 2 KV heads), tied embeddings
LLAMA_GQA = dict(ew.TIED)


def main():
    port, out_path = sys.argv[1:3]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK="0"
    )
    torch.set_num_threads(1)
    res = {}
    try:
        ew.set_mesh(dict())
        layouts = {
            "trailing_pad": ew.make_mbs(3, [[9, 31, 5, 1], [40], [2, 17, 11]], pad=8),
            "padded_slots": ew.make_mbs(4, [[9, 30, 5], [3, 21]], pad=4, cp=2),
            # groups sharing prompts (computed once), a lone sample, a 1-token prompt
            "shared_prompts": group_batches.make_group_mbs(
                6,
                [
                    [(11, [3, 7, 1, 5]), (6, [4]), (9, [2, 6, 6])],
                    [(1, [5, 4]), (23, [9, 2, 12, 4, 3, 8])],
                ],
            ),
        }
        from areal_mega.engine import megatron_engine as me

        real_processor = me.logits_at_rows
        for tag, mbs in layouts.items():
            assert all("segment_ids" in mb for mb in mbs)
            ref = ew.reference(LLAMA_GQA, mbs, seed=5, loss=ew.POLICY)
            rows = []  # the policy loss trains on logits of its loss-mask rows only
            me.logits_at_rows = lambda **kw: (
                rows.append(int(kw["context"].numel())) or real_processor(**kw)  # noqa: B023
            )
            eng = ew.check_layout(res, tag, LLAMA_GQA, ref, mbs)
            me.logits_at_rows = real_processor
            res[f"{tag}.trained_logit_rows"] = rows
            res[f"{tag}.tokens"] = [int(torch.as_tensor(mb["input_ids"]).numel()) for mb in mbs]
            attn = eng.model_chunks()[0].decoder.layers[0].self_attention.core_attention
            res[f"{tag}.varlen_module"] = type(attn).__name__
            batch = eng._prepare(mbs[0])
            res[f"{tag}.model_tokens"] = [int(eng._prepare(mb)["input_ids"].numel()) for mb in mbs]
            res[f"{tag}.thd_no_mask"] = (
                batch["attention_mask"] is None and batch["packed_seq_params"].qkv_format == "thd"
            )
    except Exception:
        res["error"] = traceback.format_exc()
    return ew.finish_rank(res, out_path)


if __name__ == "__main__":
    sys.exit(main())

"""THD PackedSeqParams: padded offsets only where sequences are padded (TransformerEngine
otherwise assumes padding between sequences, or compares the tensors on the device)."""

import types

import pytest
import torch

from areal_mega.engine.packed_params import packed_seq_kwargs
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train.batches import next_token_layout


def _mb(lens, cp=1, pad=1):
    seqs = [next_token_layout(torch.arange(100 * i, 100 * i + n)) for i, n in enumerate(lens)]
    return pack_sequences(seqs, pad_to_multiple=pad, cp_size=cp)


def test_no_padding_between_sequences_gives_no_padded_offsets():
    mb = _mb([3, 1, 2], pad=8)  # T = 8, trailing padding 2
    kw = packed_seq_kwargs(mb["cu_seqlens"], mb["cu_seqlens_padded"], 8)
    assert kw["cu_seqlens_q_padded"] is None and kw["cu_seqlens_kv_padded"] is None
    assert kw["cu_seqlens_q"].tolist() == [0, 3, 4, 6, 8]  # trailing pad = one more sequence
    assert kw["cu_seqlens_q"] is kw["cu_seqlens_kv"] and kw["cu_seqlens_q"].dtype == torch.int32
    assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == 3 and isinstance(kw["max_seqlen_q"], int)
    assert packed_seq_kwargs(mb["cu_seqlens"], None, 6)["cu_seqlens_q"].tolist() == [0, 3, 4, 6]


def test_cp_padding_gives_padded_offsets():
    mb = _mb([5, 3], cp=2, pad=4)  # slots of 8 and 4
    kw = packed_seq_kwargs(mb["cu_seqlens"], mb["cu_seqlens_padded"], 12, cp=2)
    assert kw["cu_seqlens_q"].tolist() == [0, 5, 8]
    assert kw["cu_seqlens_q_padded"].tolist() == [0, 8, 12]
    assert kw["cu_seqlens_kv_padded"] is kw["cu_seqlens_q_padded"]
    assert kw["max_seqlen_q"] == 8


def test_cp_without_padding_passes_the_same_tensor():
    mb = _mb([4, 8], cp=2, pad=4)  # already multiples of 2·CP
    kw = packed_seq_kwargs(mb["cu_seqlens"], mb["cu_seqlens_padded"], 12, cp=2)
    assert kw["cu_seqlens_q_padded"] is kw["cu_seqlens_q"]  # TE >= 2.18: no padding


def test_bad_offsets_name_the_problem():
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        packed_seq_kwargs(torch.tensor([0, 3]), torch.tensor([0, 3, 5]), 8)
    with pytest.raises(ValueError, match="beyond the packed length"):
        packed_seq_kwargs(torch.tensor([0, 3]), torch.tensor([0, 9]), 8)


def test_engine_prepare_passes_no_padded_offsets_at_cp1():
    """The engine's own _prepare on the TE path (use_te forced, CPU tensors)."""
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply()
    from areal_mega.engine.megatron_engine import MegatronEngine

    mesh = types.SimpleNamespace(
        dims=types.SimpleNamespace(tp=1, cp=1),
        sequence_parallel=False,
        device=torch.device("cpu"),
        cp_rank=0,
    )
    fake = types.SimpleNamespace(
        mesh=mesh,
        use_te=True,
        replay=None,  # no routing replay
        shares_prompt_prefix=False,
    )  # never with TE
    batch = MegatronEngine._prepare(fake, _mb([3, 1, 2], pad=8))
    p = batch["packed_seq_params"]
    assert p.qkv_format == "thd" and batch["attention_mask"] is None
    assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None
    assert p.cu_seqlens_q.tolist() == [0, 3, 4, 6, 8] and p.max_seqlen_q == 3


def test_seq_idx_numbers_each_slot_as_megatron_derives_it():
    """Mamba layers read ``seq_idx`` (without it a pack is scanned as one sequence): built on
    the host, equal to what ``PackedSeqParams`` derives on the device from ``total_tokens``;
    trailing padding is one more sequence, CP padding belongs to its sequence's slot."""
    from megatron.core.packed_seq_params import PackedSeqParams

    for lens, cp, pad, total in (([3, 1, 2], 1, 8, 8), ([5, 3], 2, 4, 12), ([4, 8], 2, 4, 12)):
        mb = _mb(lens, cp=cp, pad=pad)
        kw = packed_seq_kwargs(mb["cu_seqlens"], mb["cu_seqlens_padded"], total, cp=cp)
        params = PackedSeqParams(**kw)
        ref = PackedSeqParams(**dict(kw, seq_idx=None, total_tokens=total))
        assert params.total_tokens is None and params.seq_idx.dtype == torch.int32
        assert torch.equal(params.seq_idx, ref.seq_idx), (lens, params.seq_idx, ref.seq_idx)
    kw = packed_seq_kwargs(torch.tensor([0, 3, 4, 6]), None, 8)
    assert kw["seq_idx"].tolist() == [[0, 0, 0, 1, 2, 2, 3, 3]]
    kw = packed_seq_kwargs(torch.tensor([0, 5, 8]), torch.tensor([0, 8, 12]), 12, cp=2)
    assert kw["seq_idx"].tolist() == [[0] * 8 + [1] * 4]

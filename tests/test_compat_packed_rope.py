"""The packed-RoPE speed patch (areal_mega/compat/packed_rope.py): bit-identical to
megatron-core's per-sequence THD RoPE, one rotation call per attention instead of one per
packed sequence, and the engine's logprobs unchanged."""

import pytest
import torch
import torch.distributed as dist

from areal_mega.compat import megatron_cpu


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.new_group([0])


def _rope():
    megatron_cpu.apply()
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_rope_equals_upstream_bit_for_bit(one_rank_group, interleaved):
    rope_utils = _rope()
    patched = rope_utils._apply_rotary_pos_emb_thd
    upstream = patched.__wrapped_original__
    assert patched is not upstream
    g = torch.Generator().manual_seed(3)
    lens = [5, 1, 17, 9, 2]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    t = torch.randn(sum(lens), 4, 16, generator=g)
    freqs = torch.randn(32, 1, 1, 12, generator=g)  # rot dim 12 < 16: a pass-through part
    for mscale in (1.0, 0.7):
        want = upstream(
            t, cu, freqs, rotary_interleaved=interleaved, mscale=mscale, cp_group=one_rank_group
        )
        got = patched(
            t, cu, freqs, rotary_interleaved=interleaved, mscale=mscale, cp_group=one_rank_group
        )
        assert torch.equal(got, want)
    # frequencies for the whole packed batch: upstream's own branch, same answer
    whole = torch.randn(sum(lens), 1, 1, 16, generator=g)
    assert torch.equal(
        patched(t, cu, whole, cp_group=one_rank_group),
        upstream(t, cu, whole, cp_group=one_rank_group),
    )


def test_packed_rope_rotates_once_not_per_sequence(one_rank_group):
    rope_utils = _rope()
    lens = [3] * 40
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    t, freqs = torch.randn(sum(lens), 2, 8), torch.randn(8, 1, 1, 8)

    def cos_calls(fn):
        with torch.profiler.profile() as prof:
            fn(t, cu, freqs, cp_group=one_rank_group)
        return [e.name for e in prof.events()].count("aten::cos")

    assert cos_calls(rope_utils._apply_rotary_pos_emb_thd) == 1
    assert cos_calls(rope_utils._apply_rotary_pos_emb_thd.__wrapped_original__) == len(lens)


def test_the_patch_is_listed_and_checked():
    (patch,) = [p for p in megatron_cpu.PATCHES if p.name == "packed_thd_rope"]
    assert patch.check() == []
    assert "speed" in patch.why

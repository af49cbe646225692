"""The export's tensor-parallel gather axis comes from shapes, not from ``partition_dim``.

TE's ``GroupedLinear`` (megatron's ``TEGroupedLinear`` with explicit expert communication)
marks the row-parallel expert ``linear_fc2`` with ``partition_dim=0`` although its shards are
split on dim 1; the export must still produce HF ``down_proj`` of shape [hidden, moe_ffn].
"""

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

from areal_mega.checkpoint.export import expected_full_shape, gather_axis
from areal_mega.common.net import free_port
from areal_mega.models.builder import HFArch
from tests.helpers.multirank import run_ranks

H, MOE_FFN, TP = 6, 8, 2
ROOT = Path(__file__).resolve().parents[1]


def tiny_moe_arch() -> HFArch:
    return HFArch(
        model_type="qwen3_moe",
        vocab_size=32,
        hidden_size=H,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        ffn_hidden_size=10,
        max_position_embeddings=64,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=True,
        num_experts=2,
        moe_topk=1,
        moe_ffn_hidden_size=MOE_FFN,
    )


def full_fc1() -> torch.Tensor:
    return torch.arange(2 * MOE_FFN * H, dtype=torch.float32).reshape(2 * MOE_FFN, H)


def full_fc2() -> torch.Tensor:
    return 1000 + torch.arange(H * MOE_FFN, dtype=torch.float32).reshape(H, MOE_FFN)


def test_row_parallel_shard_gathers_on_dim1():
    assert gather_axis("fc2", (H, MOE_FFN // TP), (H, MOE_FFN), TP) == 1


def test_column_parallel_and_vector_shards_gather_on_dim0():
    assert gather_axis("qkv", (8, H), (16, H), 2) == 0
    assert gather_axis("qkv.bias", (8,), (16,), 2) == 0
    assert gather_axis("embedding", (16, H), (None, H), 4) == 0  # padded vocab: rows free


def test_tp1_needs_no_gather_but_checks_shapes():
    assert gather_axis("fc2", (H, MOE_FFN), (H, MOE_FFN), 1) is None
    with pytest.raises(ValueError, match="fc2.*does not match"):
        gather_axis("fc2", (H, 3), (H, MOE_FFN), 1)


def test_no_axis_fits_names_the_parameter():
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.x\.weight.*no axis fits"):
        gather_axis("decoder.layers.0.x.weight", (H, 3), (H, MOE_FFN), 2)
    with pytest.raises(ValueError, match="w: local shard shape .* 2 dims"):
        gather_axis("w", (H, 4), (H * 4,), 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        gather_axis("w", (H,), (H,), 0)


def test_ambiguous_axis_names_the_parameter():
    with pytest.raises(ValueError, match=r"mystery\.weight.*ambiguous: axes \[0, 1\]"):
        gather_axis("mystery.weight", (4, 4), None, 2)


def test_expected_full_shapes_from_the_hf_config():
    arch = tiny_moe_arch()
    fc2 = "mlp.experts.local_experts.{E}.linear_fc2.weight"
    assert expected_full_shape(arch, fc2) == (H, MOE_FFN)
    assert expected_full_shape(arch, "mlp.experts.local_experts.{E}.linear_fc1.weight") == (
        2 * MOE_FFN,
        H,
    )
    assert expected_full_shape(arch, "self_attention.linear_qkv.weight") == (16, H)
    assert expected_full_shape(arch, "self_attention.linear_proj.weight") == (H, 8)
    assert expected_full_shape(arch, "output_layer.weight") == (None, H)
    assert expected_full_shape(arch, "input_layernorm.weight") is None
    assert expected_full_shape(arch, "mlp.linear_fc1.weight") == (20, H)  # [gate; up]
    # a non-gated MLP (Nemotron's squared ReLU): fc1 is the up projection alone
    plain = dataclasses.replace(arch, gated_mlp=False, num_experts=None)
    assert expected_full_shape(plain, "mlp.linear_fc1.weight") == (10, H)


def test_te_grouped_fc2_with_lying_partition_dim_exports_down_proj(tmp_path):
    """Two gloo ranks export a TE-grouped-GEMM expert layer at expert TP 2."""
    port, out = free_port(), tmp_path / "export.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for rc, log in run_ranks(
        [[sys.executable, __file__, r, port, out] for r in range(TP)],
        timeout=240,
        env=env,
        cwd=ROOT,
    ):
        assert rc == 0, log[-4000:]
    got = torch.load(out)
    x = "model.layers.0.mlp.experts.0."
    assert set(got) == {x + "gate_proj.weight", x + "up_proj.weight", x + "down_proj.weight"}
    assert torch.equal(got[x + "down_proj.weight"], full_fc2())
    assert torch.equal(got[x + "gate_proj.weight"], full_fc1()[:MOE_FFN])
    assert torch.equal(got[x + "up_proj.weight"], full_fc1()[MOE_FFN:])


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    from areal_mega.checkpoint.export import iter_hf_tensors

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    solo = [dist.new_group([r]) for r in range(TP)][rank]
    n = MOE_FFN // TP
    gate, up = full_fc1().chunk(2)
    fc1 = torch.cat([gate[rank * n : (rank + 1) * n], up[rank * n : (rank + 1) * n]])
    fc2 = full_fc2()[:, rank * n : (rank + 1) * n]
    layer = nn.Module()
    layer.layer_number = 1
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.Module()
    for mod_name, shard in (("linear_fc1", fc1), ("linear_fc2", fc2)):
        mod = nn.Module()
        w = nn.Parameter(shard.clone())
        w.tensor_model_parallel, w.partition_dim = True, 0  # fc2's partition_dim lies
        mod.register_parameter("weight0", w)
        setattr(layer.mlp.experts, mod_name, mod)
    chunk = nn.Module()
    chunk.decoder = nn.Module()
    chunk.decoder.layers = nn.ModuleList([layer])
    world = dist.group.WORLD
    got = {
        k: v.clone()
        for k, v in iter_hf_tensors(
            [chunk], tiny_moe_arch(), tp_group=world, ep_group=solo, etp_group=world
        )
    }
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

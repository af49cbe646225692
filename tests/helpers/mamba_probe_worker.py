"""megatron-core's MambaMixer on the CPU, without and with areal_mega.compat.megatron_cpu.

    python -m tests.helpers.mamba_probe_worker
        -> prints MAMBA_PROBE {"unpatched": {kernel: present}, "patched": {what: difference}}

The patched run builds the mixer, runs three packed sequences (``PackedSeqParams`` as the
engine builds them, engine/packed_params.py, whose ``seq_idx`` separates them) and compares
output and gradients with transformers' Nemotron-H mixer run on each sequence alone with the
same weights. Run in a fresh process: the patches are process-global once applied.
"""

import json
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

LENGTHS = (70, 3, 90)  # megatron's chunk: 32; transformers' one chunk per sequence (its
# multi-chunk state passing is wrong: tests/test_mamba_cpu.py)


def _build():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer import TransformerConfig

    from areal_mega.parallel.mesh import init_distributed

    if not dist.is_initialized():
        init_distributed()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=24,
        num_attention_heads=2,
        mamba_state_dim=6,
        mamba_head_dim=8,
        mamba_num_groups=2,
        mamba_num_heads=4,
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    return MambaMixer(
        config,
        MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=24,
        d_conv=4,
        chunk_size=32,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def mixer_matches_transformers() -> dict:
    """Worst output / gradient differences (relative to the reference's largest entry) of
    megatron's mixer on the packed sequences against transformers' per sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from areal_mega.engine.packed_params import packed_seq_kwargs

    mixer = _build()
    torch.manual_seed(0)
    ref = NemotronHMamba2Mixer(
        NemotronHConfig(
            hidden_size=24,
            mamba_num_heads=4,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=6,
            conv_kernel=4,
            chunk_size=128,
            use_conv_bias=True,
            use_bias=False,
            use_mamba_kernels=False,
            layer_norm_epsilon=1e-5,  # megatron's fixed norm epsilon
            time_step_min=0.0,  # transformers' torch path only: megatron has no clamp
        ),
        layer_idx=0,
    )
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        ref.norm.weight.add_(1.0)
        ref.A_log.copy_(torch.rand_like(ref.A_log) * 2 - 1)
        mixer.in_proj.weight.copy_(ref.in_proj.weight)
        mixer.conv1d_weight.copy_(ref.conv1d.weight)
        mixer.conv1d_bias.copy_(ref.conv1d.bias)
        mixer.dt_bias.copy_(ref.dt_bias)
        mixer.A_log.copy_(ref.A_log)
        mixer.D.copy_(ref.D)
        mixer.norm.weight.copy_(ref.norm.weight)
        mixer.out_proj.weight.copy_(ref.out_proj.weight)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    packed = PackedSeqParams(**packed_seq_kwargs(cu, None, total))  # the engine's, as it packs
    x = torch.randn(total, 1, 24, requires_grad=True)
    out, bias = mixer(x, packed_seq_params=packed)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    want = torch.cat([ref(x[s:e].transpose(0, 1)) for s, e in bounds], 1).transpose(0, 1)
    dy = torch.randn_like(out)
    names = ["in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight"]
    mine = [
        x,
        mixer.in_proj.weight,
        mixer.conv1d_weight,
        mixer.dt_bias,
        mixer.A_log,
        mixer.D,
        mixer.norm.weight,
    ]
    theirs = [x, *(dict(ref.named_parameters())[n] for n in names)]
    got = torch.autograd.grad((out * dy).sum(), mine)
    exp = torch.autograd.grad((want * dy).sum(), theirs)

    def rel(a, b):
        return float((a - b).abs().max()) / float(b.abs().max())

    res = {"out": rel(out, want), "bias_is_none": bias is None}
    res.update({f"grad:{n}": rel(a, b) for n, a, b in zip(["x", *names], got, exp)})
    return res


def main():
    from megatron.core.ssm import mamba_mixer

    # without the patches: whether the kernels the training path calls are there
    unpatched = {
        "have_mamba_ssm": mamba_mixer.HAVE_MAMBA_SSM,
        "fused_scan": mamba_mixer.mamba_split_conv1d_scan_combined is not None,
        "causal_conv1d": mamba_mixer.causal_conv1d_fn is not None,
    }
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply(force=True)
    print(
        "MAMBA_PROBE "
        + json.dumps({"unpatched": unpatched, "patched": mixer_matches_transformers()})
    )


if __name__ == "__main__":
    main()

"""Probe upstream megatron-core on CPU with and without areal_mega.compat.megatron_cpu.

    python -m tests.helpers.compat_probe_worker
        -> prints JSON {"unpatched": {...}, "patched": {...}, "scope": {...} or null}

Each probe returns True when the code works on CPU. Run in a fresh process: the patches are
process-global once applied. The patched ``import megatron.bridge`` (in a fresh process of its
own) also reports, when TransformerEngine is not installed, what sees the TE placeholder
there (``scope``, :data:`SCOPE_PROBE`; checked in tests/test_engine_compat.py).
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

# run after ``megatron_cpu.apply(force=True); import megatron.bridge``: who sees the placeholder
SCOPE_PROBE = """
import importlib.util, json, torch
from megatron.bridge.peft import lora_layers
from megatron.core.extensions import transformer_engine as mte
from megatron.core.utils import get_te_version
from areal_mega.models.backend import probe_te
te = lora_layers.te
holders = sorted(n for n, m in list(sys.modules.items()) if m is not None and
                 n not in ("__main__", "__mp_main__") and
                 any(v is te for v in list(vars(m).values())))
try:
    te.Linear(4, 4)
    made = True
except ImportError:
    made = False
print("SCOPE " + json.dumps(dict(
    in_sys_modules=[n for n in sys.modules if n.split(".")[0] == "transformer_engine"],
    find_spec=importlib.util.find_spec("transformer_engine") is not None,
    mcore_have_te=mte.HAVE_TE, te_version=str(get_te_version()), probe=probe_te().state,
    holders=holders, instantiable=made,
    isinstance_linear=isinstance(torch.nn.Linear(2, 2), (te.Linear, te.LayerNormLinear)),
    nested=te.ops.Sequential.__qualname__)))
"""
SCOPE: dict = {}  # the patched bridge import's SCOPE_PROBE answer


def _ok(fn):
    try:
        return bool(fn())
    except Exception:
        return False


def gated_delta_net_matches_transformers() -> bool:
    """megatron-core's ``GatedDeltaNet`` (local linears, the zero-centred norm Qwen3-Next's
    provider asks for) on three packed sequences, against transformers'
    ``Qwen3NextGatedDeltaNet`` run on each sequence alone with the same weights: output and
    input gradient within 1e-5 of the reference's scale. Raises (the probe: False) without
    fla and without the CPU patch."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer import TransformerConfig
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from areal_mega.models.gemma3 import Gemma3RMSNorm
    from areal_mega.parallel.mesh import init_distributed

    if not dist.is_initialized():
        init_distributed()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    nk, nv, dk, dv, hidden, width = 2, 4, 8, 6, 32, 4
    ref = Qwen3NextGatedDeltaNet(
        Qwen3NextConfig(
            hidden_size=hidden,
            linear_num_key_heads=nk,
            linear_num_value_heads=nv,
            linear_key_head_dim=dk,
            linear_value_head_dim=dv,
            linear_conv_kernel_dim=width,
        ),
        0,
    ).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=2,
        linear_conv_kernel_dim=width,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        use_cpu_initialization=True,
        add_bias_linear=False,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=1,
    )
    gdn = GatedDeltaNet(
        config,
        GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=Gemma3RMSNorm, out_proj=RowParallelLinear
        ),
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    r = nv // nk
    with torch.no_grad():  # transformers' per-key-head groups -> megatron's [q k v z b a]
        q, k, v, z = ref.in_proj_qkvz.weight.view(nk, -1, hidden).split(
            [dk, dk, r * dv, r * dv], dim=1
        )
        b, a = ref.in_proj_ba.weight.view(nk, 2 * r, hidden).split([r, r], dim=1)
        gdn.in_proj.weight.copy_(torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]))
        gdn.conv1d.weight.copy_(ref.conv1d.weight)
        gdn.A_log.copy_(ref.A_log)
        gdn.dt_bias.copy_(ref.dt_bias)
        gdn.out_norm.weight.copy_(ref.norm.weight - 1)
        gdn.out_proj.weight.copy_(ref.out_proj.weight)
    cu = torch.tensor([0, 70, 73, 163], dtype=torch.int32)  # 70 > one chunk of 64
    x = torch.randn(int(cu[-1]), 1, hidden, requires_grad=True)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=90, max_seqlen_kv=90
    )
    out, _ = gdn(x, None, packed_seq_params=packed)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    want = torch.cat([ref(x[s:e].transpose(0, 1)) for s, e in bounds], 1).transpose(0, 1)
    dy = torch.randn_like(out)
    (got_dx,) = torch.autograd.grad((out * dy).sum(), x)
    (want_dx,) = torch.autograd.grad((want * dy).sum(), x)
    return all(
        float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
        for g, w in ((out, want), (got_dx, want_dx))
    )


def probes():
    import numpy as np
    from megatron.core import utils as cutils
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as tpr
    from megatron.core.transformer import utils as tutils
    from megatron.core.transformer.moe import moe_utils

    def rng():
        t = tpr.CudaRNGStatesTracker()
        t.add("probe", 1234)
        with t.fork("probe"):
            torch.rand(1)
        return True

    def clip():
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=10.0)
        return abs(float(p.grad[0]) - 0.1) < 1e-5

    def bridge_imports():
        """``import megatron.bridge`` in a fresh process (it needs TransformerEngine), with
        the patches there when they are applied here."""
        import importlib.util
        import subprocess

        from areal_mega.compat import megatron_cpu

        patched = megatron_cpu.is_applied()
        pre = (
            "from areal_mega.compat import megatron_cpu; megatron_cpu.apply(force=True); "
            if patched
            else ""
        )
        # patched and without TE: the same process then reports the placeholder's scope
        scope = patched and importlib.util.find_spec("transformer_engine") is None
        from tests.helpers.workers import ROOT

        root = str(ROOT)
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                pre + "import megatron.bridge, sys\n" + (SCOPE_PROBE if scope else ""),
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, PYTHONPATH=root, PYTHONWARNINGS="ignore"),
        )
        if scope:
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("SCOPE ")]
            SCOPE.update(
                json.loads(line[0][6:])
                if line
                else {"error": proc.stdout[-2000:] + proc.stderr[-3000:]}
            )
        return proc.returncode == 0

    return {
        "import_megatron_bridge": bridge_imports,
        "rng_tracker": rng,
        "rope_inv_freq_device": lambda: (
            rope.RotaryEmbedding(16, 1.0, use_cpu_initialization=False).inv_freq.device.type
            == "cpu"
        ),
        "default_causal_mask": lambda: tutils.get_default_causal_mask(4).shape == (4, 4),
        "global_memory_buffer": lambda: (
            cutils.GlobalMemoryBuffer().get_tensor([2, 2], torch.float32, "probe").shape == (2, 2)
        ),
        "moe_splits_numpy": lambda: isinstance(
            moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True), np.ndarray
        ),
        "clip_grads_type": clip,
        "gated_delta_net_fla": gated_delta_net_matches_transformers,
    }


def main():
    out = {"unpatched": {k: _ok(f) for k, f in probes().items()}}
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply(force=True)
    out["patched"] = {k: _ok(f) for k, f in probes().items()}
    out["scope"] = SCOPE or None
    print("PROBE " + json.dumps(out))


if __name__ == "__main__":
    main()

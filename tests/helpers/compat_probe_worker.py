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

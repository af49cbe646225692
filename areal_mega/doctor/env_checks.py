"""The doctor's checks of what is installed: Python and the pinned packages, the csrc kernels
(and the ISA they run), megatron-core's CPU patches, oneDNN, and the logprob / GAE kernels'
numbers against the pure-torch reference."""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional, Tuple

from areal_mega.doctor.rows import Check, CheckFailed, Context

PYTHON_MIN = (3, 12)  # setup.py python_requires


PIN_FILES = ("requirements.txt", "requirements-nodeps.txt")  # the second: pip --no-deps


def read_pins(root: Path) -> List[str]:
    """The requirement lines of ``requirements.txt`` and ``requirements-nodeps.txt`` under
    ``root`` (or, installed without a checkout, the package's own metadata)."""
    if (root / PIN_FILES[0]).is_file():
        lines = [
            ln.split("#", 1)[0].strip()
            for name in PIN_FILES
            if (root / name).is_file()
            for ln in (root / name).read_text().splitlines()
        ]
        return [ln for ln in lines if ln]
    from importlib.metadata import requires

    return [r for r in requires("areal-mega") or () if "extra ==" not in r]


def version_problems(pins: List[str]) -> Tuple[List[str], int]:
    """``(problems, n_checked)``: each pin not installed or installed at another version."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    probs = []
    for line in pins:
        req = Requirement(line)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            probs.append(f"{req.name} missing (want {req.specifier})")
            continue
        if not req.specifier.contains(have, prereleases=True):
            probs.append(f"{req.name} {have} (want {req.specifier})")
    return probs, len(pins)


def check_python(ctx: Context) -> str:
    """This interpreter's version against the package's minimum."""
    v = sys.version_info
    if v[:2] < PYTHON_MIN:
        raise CheckFailed(f"Python {v.major}.{v.minor} < {PYTHON_MIN[0]}.{PYTHON_MIN[1]}")
    return f"Python {v.major}.{v.minor}.{v.micro} ({sys.executable})"


def check_packages(ctx: Context) -> str:
    """Every pin of ``requirements.txt`` installed at its pinned version."""
    probs, n = version_problems(read_pins(ctx.root))
    if probs:
        raise CheckFailed(f"{len(probs)} of {n} pins differ: " + "; ".join(probs))
    return f"{n} pinned packages at their pinned versions"


def cpu_best_isa(flags: Optional[set] = None) -> str:
    """The best vector ISA of the kernels this CPU supports (``/proc/cpuinfo`` flags)."""
    if flags is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
        m = re.search(r"^flags\s*:(.*)$", text, re.M)
        flags = set(m.group(1).split()) if m else set()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "generic"


def check_kernels(ctx: Context) -> str:
    """``areal_mega._ops_cpu`` (and with CUDA ``_ops_cuda``) imports from this package; the
    vector ISA it runs is the best this CPU has (unless capped)."""
    import torch

    from areal_mega.ops import _backend

    mod = _backend.native_module(torch.device("cpu"))
    if mod is None:
        raise CheckFailed(
            f"areal_mega._ops_cpu not importable: {_backend._errors.get('_ops_cpu')}",
            f"build the kernels: {_backend.BUILD_HINT}",
        )
    here = Path(_backend.__file__).resolve().parents[1]
    if Path(mod.__file__).resolve().parent != here:
        # e.g. an editable install of another checkout answering for the missing module
        raise CheckFailed(
            f"areal_mega._ops_cpu loaded from {mod.__file__}, not from this "
            f"package ({here}): this checkout's kernels are not built",
            f"build the kernels here: {_backend.BUILD_HINT}",
        )
    running, best = mod.cpu_isa(), cpu_best_isa()
    cap = os.environ.get(_backend.KERNEL_ISA_ENV)
    detail = f"_ops_cpu runs {running} (CPU has {best}" + (
        f"; capped by {_backend.KERNEL_ISA_ENV}={cap})" if cap else ")"
    )
    if not cap and best != "unknown" and running != best:
        raise CheckFailed(
            detail, "rebuild the kernels on this machine: python setup.py build_ext --inplace"
        )
    if torch.cuda.is_available():
        cuda = _backend.native_module(torch.device("cuda"))
        if cuda is None:
            raise CheckFailed(
                f"{detail}; areal_mega._ops_cuda not importable: "
                f"{_backend._errors.get('_ops_cuda')}",
                f"build the CUDA kernels (nvcc on PATH): {_backend.BUILD_HINT}",
            )
        cap_major, cap_minor = torch.cuda.get_device_capability()
        detail += f"; _ops_cuda on sm_{cap_major}{cap_minor} ({torch.cuda.get_device_name()})"
    return detail


def check_megatron_patches(ctx: Context) -> str:
    """Without CUDA: apply megatron-core's CPU patches (pinned release, every patched source
    found); with CUDA: not needed."""
    from areal_mega.compat import megatron_cpu

    if not megatron_cpu.needed():
        return "not needed: CUDA is available (megatron-core runs unpatched)"
    try:
        megatron_cpu.apply()
    except megatron_cpu.CompatError as e:
        lines = str(e).splitlines()
        raise CheckFailed(
            f"{len(lines) - 1} mismatch(es): "
            + "; ".join(ln.strip() for ln in lines[1:4])
            + (" ..." if len(lines) > 4 else ""),
            f"install megatron-core=={megatron_cpu.MEGATRON_CORE_VERSION} (the release "
            "areal_mega/compat/megatron_cpu.py patches), or update that module's patches",
        ) from None
    import megatron.core

    return (
        f"{len(megatron_cpu.PATCHES)} CPU patches applied to megatron-core "
        f"{megatron_cpu.MEGATRON_CORE_VERSION} ({Path(megatron.core.__file__).parent})"
    )


def check_onednn(ctx: Context) -> str:
    """oneDNN's linear ops the trainer and the CPU server use exist and equal the float64
    product (plain and prepacked weights)."""
    import torch

    from areal_mega.inference.cpu_linear import onednn_linear_available

    if not onednn_linear_available():
        raise CheckFailed(
            "torch.ops.mkldnn._linear_pointwise / _reorder_linear_weight missing "
            f"or oneDNN off (torch {torch.__version__})"
        )
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(33, 64, generator=g), torch.randn(48, 64, generator=g)
    want = x.double() @ w.double().t()
    plain = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    packed = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], ""
    )
    err = max((y.double() - want).abs().max().item() for y in (plain, packed))
    if err > 1e-3:
        raise CheckFailed(f"oneDNN linear differs from the float64 product by {err:.2e}")
    return f"oneDNN linear (plain and prepacked) = x @ w.T to {err:.1e}"


@contextmanager
def ops_backend(mode: str):
    """Run the ``areal_mega.ops`` calls inside with ``AREAL_MEGA_OPS_BACKEND=mode``."""
    old = os.environ.get("AREAL_MEGA_OPS_BACKEND")
    os.environ["AREAL_MEGA_OPS_BACKEND"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("AREAL_MEGA_OPS_BACKEND", None)
        else:
            os.environ["AREAL_MEGA_OPS_BACKEND"] = old


def logprob_case(dtype, seed: int = 0, T: int = 48, V: int = 5003):
    """Logits ``[T, V]`` of ``dtype`` (V a multiple of no vector width), labels with one
    padding position, and the upstream gradients for logprob and entropy."""
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[5] = -1
    return logits, labels, torch.randn(T, generator=g), torch.randn(T, generator=g)


def logprob_fwd_bwd(logits, labels, g_lp, g_ent, device: str = "cpu"):
    """``(logprob, entropy, dlogits)`` of :func:`areal_mega.ops.packed_logprobs` on
    ``device`` with the backend in force, as float64 CPU tensors."""
    import torch

    from areal_mega.ops import packed_logprobs

    x = logits.to(device).requires_grad_()
    lp, ent = packed_logprobs(x, labels.to(device), return_entropy=True)
    (gx,) = torch.autograd.grad((lp * g_lp.to(device)).sum() + (ent * g_ent.to(device)).sum(), x)
    return lp.detach().double().cpu(), ent.detach().double().cpu(), gx.double().cpu()


def max_rel_errors(got, want) -> List[float]:
    """Per pair of tensors: max |a - b| over max(1, max |b|)."""
    return [((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(got, want)]


GAE_CASE = dict(gamma=0.99, lam=0.95)


def gae_case(device: str = "cpu"):
    """Advantages and returns of :func:`areal_mega.ops.packed_gae` on a fixed packed batch
    (bootstrap values and a loss mask included), as CPU tensors."""
    import torch

    from areal_mega.ops import packed_gae

    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(300, generator=g), torch.randn(300, generator=g)
    cu = torch.tensor([0, 7, 120, 121, 300], dtype=torch.int32)
    boot, mask = torch.randn(4, generator=g), torch.rand(300, generator=g) > 0.2
    a, ret = packed_gae(
        r.to(device),
        v.to(device),
        cu.to(device),
        bootstrap_values=boot.to(device),
        loss_mask=mask.to(device),
        **GAE_CASE,
    )
    return a.cpu(), ret.cpu()


def check_logprob_kernel(ctx: Context) -> str:
    """The C++ logprob kernels (fp32, bf16; logprob, entropy, gradient) and GAE against the
    pure-torch reference."""
    import torch

    from areal_mega.ops import _backend
    from areal_mega.ops.reference import logprobs_naive

    if not _backend.cpu_available():
        raise CheckFailed(
            "areal_mega._ops_cpu not built: nothing to compare (see kernels)",
            f"build the kernels: {_backend.BUILD_HINT}",
        )
    worst = []
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2)):
        logits, labels, g_lp, g_ent = logprob_case(dtype)
        with ops_backend("native"):
            got = logprob_fwd_bwd(logits, labels, g_lp, g_ent)
        ref = logits.double().requires_grad_()
        lp, ent = logprobs_naive(ref, labels, return_entropy=True)
        (gref,) = torch.autograd.grad(
            (lp * g_lp.double()).sum() + (ent * g_ent.double()).sum(), ref
        )
        errs = max_rel_errors(got, (lp.detach(), ent.detach(), gref))
        if max(errs) > tol:
            raise CheckFailed(
                f"{dtype}: logprob/entropy/grad differ from the reference by "
                f"{', '.join(f'{e:.1e}' for e in errs)} (> {tol:.0e})",
                "rebuild the kernels; run tests/test_ops_logprob.py",
            )
        worst.append(max(errs))
    with ops_backend("native"):
        native = gae_case()
    with ops_backend("torch"):
        ref_gae = gae_case()
    gae_err = max(max_rel_errors(native, ref_gae))
    if gae_err > 1e-5:
        raise CheckFailed(
            f"GAE differs from the reference by {gae_err:.1e}",
            "rebuild the kernels; run tests/test_ops_gae.py",
        )
    return (
        f"logprob+entropy+grad = torch reference (fp32 {worst[0]:.0e}, bf16 {worst[1]:.0e}); "
        f"GAE {gae_err:.0e}"
    )


CHECKS = [
    Check(
        "python",
        "the Python version",
        "use Python >= 3.12 (3.12 is what the tests run)",
        check_python,
    ),
    Check(
        "packages",
        "installed versions against requirements.txt",
        "pip install -r requirements.txt; pip install --no-deps -r requirements-nodeps.txt",
        check_packages,
    ),
    Check(
        "kernels",
        "csrc kernels built, the ISA / CUDA arch they run",
        "python setup.py build_ext --inplace",
        check_kernels,
    ),
    Check(
        "megatron-patches",
        "megatron-core CPU patches applied (or not needed)",
        "pip install -r requirements.txt",
        check_megatron_patches,
    ),
    Check(
        "onednn",
        "oneDNN linear ops present and exact",
        "install the pinned CPU torch wheel",
        check_onednn,
    ),
    Check(
        "logprob-kernel",
        "logprob/GAE kernels = pure-torch reference",
        "rebuild the kernels and run tests/test_ops_logprob.py",
        check_logprob_kernel,
        needs=("kernels",),
    ),
]

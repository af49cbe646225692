"""The doctor's rows on a CUDA machine: the CUDA kernels against the CPU kernels,
TransformerEngine (version, the attention backend it would pick), an NCCL group between two
processes, SGLang's version against the range our protocol follows. Not run without CUDA."""

from __future__ import annotations

import subprocess
import textwrap

from areal_mega.common.net import free_port
from areal_mega.doctor.env_checks import (
    gae_case,
    logprob_case,
    logprob_fwd_bwd,
    max_rel_errors,
    ops_backend,
)
from areal_mega.doctor.rows import Check, CheckFailed, CheckSkipped, Context

TE_VERSION = "2.11.0"  # setup.py TE_PIN (the [gpu] extra)
#: SGLang releases whose HTTP and weight-update protocol ours follows
#: (tests/helpers/sglang_peer_worker.py is written from SGLang v0.5.x's source)
SGLANG_RANGE = ">=0.5,<0.6"


def check_cuda_kernels(ctx: Context) -> str:
    """The CUDA logprob (fp32, bf16; forward and backward) and GAE kernels against the C++
    CPU kernels on the same inputs."""
    import torch

    from areal_mega.ops import _backend

    if not (_backend.cuda_available() and _backend.cpu_available()):
        raise CheckFailed(
            "both _ops_cuda and _ops_cpu are needed (see kernels)",
            f"build the kernels: {_backend.BUILD_HINT}",
        )
    worst = {}
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        case = logprob_case(dtype)
        with ops_backend("native"):
            cpu, gpu = logprob_fwd_bwd(*case), logprob_fwd_bwd(*case, device="cuda")
        err = max(max_rel_errors(gpu, cpu))
        if err > tol:
            raise CheckFailed(
                f"{dtype}: CUDA logprob/entropy/grad differ from the CPU kernels by "
                f"{err:.1e} (> {tol:.0e})",
                "run pytest -m gpu tests/test_ops_logprob.py",
            )
        worst[str(dtype).split(".")[-1]] = err
    with ops_backend("native"):
        gae_err = max(max_rel_errors(gae_case("cuda"), gae_case("cpu")))
    if gae_err > 1e-5:
        raise CheckFailed(
            f"CUDA GAE differs from the CPU kernel by {gae_err:.1e}",
            "run pytest -m gpu tests/test_ops_gae.py",
        )
    return (
        "CUDA = CPU kernels: "
        + ", ".join(f"{k} {v:.0e}" for k, v in worst.items())
        + f", GAE {gae_err:.0e}"
    )


def te_attention_backend() -> str:
    """The attention backend TransformerEngine picks for packed (THD) causal bf16 attention,
    as TE's own selection reports it; ``"unknown (...)"`` when this TE has no such query."""
    import torch

    try:
        from transformer_engine.pytorch.attention.dot_product_attention import utils as du

        params = du.AttentionParams(
            qkv_dtype=torch.bfloat16,
            qkv_layout="thd_thd_thd",
            num_heads=8,
            num_gqa_groups=8,
            head_dim_qk=128,
            head_dim_v=128,
            attn_mask_type="padding_causal",
        )
        res = du.get_attention_backend(params)
    except Exception as e:  # noqa: BLE001 - the query's API changes between TE releases
        return f"unknown ({type(e).__name__}: {str(e)[:80]})"
    if len(res) == 5:  # before TE 2.x: no FlashAttention sub-backend in the answer
        res = (res[0], None, *res[1:])
    flash, flash_be, fused, fused_be = res[:4]
    if flash:
        return f"flash ({flash_be})"
    return f"fused ({fused_be})" if fused else "unfused"


def check_transformer_engine(ctx: Context) -> str:
    """TransformerEngine imports at the pinned version; the attention our engine builds and
    the backend TE itself selects."""
    from areal_mega.models.backend import probe_te, resolve_attention

    st = probe_te()
    if st.state == "missing":
        raise CheckFailed(
            "TransformerEngine not installed: the GPU engine would run megatron's "
            "local attention (slow, no context parallelism)",
            "pip install --no-build-isolation -e '.[gpu]' (README, GPU install)",
        )
    if st.state == "broken":
        raise CheckFailed(
            f"TransformerEngine fails to import: {st.error}",
            "reinstall TransformerEngine against this torch and CUDA",
        )
    choice = resolve_attention("auto")
    detail = (
        f"TE {st.version}; engine spec {'TE' if choice.use_te else 'local'}, "
        f"AttnBackend {choice.backend}; TE picks {te_attention_backend()}"
    )
    if st.version.split("+")[0] != TE_VERSION:
        raise CheckFailed(
            detail + f" (pinned {TE_VERSION})", "pip install --no-build-isolation -e '.[gpu]'"
        )
    return detail


NCCL_WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), sys.argv[2]
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + port, rank=rank,
                            world_size=2)
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    print("SUM", t.sum().item(), "NCCL", ".".join(map(str, torch.cuda.nccl.version())))
    dist.destroy_process_group()
""")


def check_nccl(ctx: Context) -> str:
    """Two processes, one GPU each, form an NCCL group and all-reduce correctly (skipped
    with one GPU)."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        raise CheckSkipped(
            f"{n} GPU visible: NCCL refuses two ranks on one GPU (the weight-"
            "update group spans trainer and server GPUs)"
        )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [ctx.python, "-c", NCCL_WORKER, str(r), port],
            env=ctx.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    lines = [next((ln for ln in o.splitlines() if ln.startswith("SUM ")), None) for o in outs]
    if (
        any(p.returncode != 0 for p in procs)
        or None in lines
        or any(float(ln.split()[1]) != 12.0 for ln in lines)
    ):
        raise CheckFailed(
            "2-process NCCL all_reduce failed: "
            + " | ".join(
                o.strip().splitlines()[-1][:120] if o.strip() else "no output" for o in outs
            ),
            "check NCCL_* variables, the driver and that both GPUs are visible",
        )
    return f"2 processes, GPUs 0-1, all_reduce correct ({lines[0].split()[-1]} NCCL)"


def check_sglang(ctx: Context) -> str:
    """SGLang's installed version against :data:`SGLANG_RANGE` (skipped when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        have = version("sglang")
    except PackageNotFoundError:
        raise CheckSkipped(
            "SGLang not installed (the CPU-protocol local server still works; "
            "pip install -e '.[sglang]' for GPU rollout)"
        ) from None
    if not SpecifierSet(SGLANG_RANGE).contains(have, prereleases=True):
        raise CheckFailed(
            f"SGLang {have} outside the tested range {SGLANG_RANGE}",
            f"pip install 'sglang[all]{SGLANG_RANGE}'",
        )
    return f"SGLang {have} in {SGLANG_RANGE}"


def _cuda(fn):
    def run(ctx: Context) -> str:
        import torch

        if not torch.cuda.is_available():
            raise CheckSkipped("no CUDA device")
        return fn(ctx)

    return run


CHECKS = [
    Check(
        "cuda-kernels",
        "CUDA kernels = CPU kernels",
        "pytest -m gpu tests/test_ops_*.py",
        _cuda(check_cuda_kernels),
        needs=("kernels",),
        cuda=True,
    ),
    Check(
        "transformer-engine",
        "TransformerEngine present, its attention backend",
        "pip install --no-build-isolation -e '.[gpu]'",
        _cuda(check_transformer_engine),
        cuda=True,
    ),
    Check(
        "nccl",
        "an NCCL group between two processes",
        "check the NCCL installation",
        _cuda(check_nccl),
        cuda=True,
    ),
    Check(
        "sglang",
        f"SGLang installed, version in {SGLANG_RANGE}",
        "pip install -e '.[sglang]'",
        _cuda(check_sglang),
        cuda=True,
    ),
]

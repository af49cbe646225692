"""Which attention implementation and which GPU fusions a model is built with.

Three pure decisions, each a function of facts probed once from the environment, so every
branch is unit-testable on a CPU machine:

* :func:`probe_te` -- is TransformerEngine installed, importable (and which version), or
  installed but broken. Only a missing ``transformer_engine`` module means "no TE"; a package
  that is present but fails to import (a CUDA/cuDNN library mismatch, an ABI error, a missing
  dependency of TE) is reported, never silently treated as absent: without TE the engine falls
  back to megatron's local spec (per-sequence torch SDPA), far slower than TE's kernels on GPU
  and without context parallelism.
* :func:`select_attention` -- ``model.attention_backend`` (auto / flash / fused / unfused /
  local) + CUDA + TE status -> TE layer spec or megatron's local spec, and megatron's
  ``AttnBackend``. On CUDA without a usable TE it refuses unless the user asked for ``local``.
* :func:`decide_fusions` -- ``apply_rope_fusion``, ``bias_activation_fusion`` and
  ``gradient_accumulation_fusion``: on only on CUDA and only where the installed TE / apex
  provide the kernels megatron-core calls; all off on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

from areal_mega.parallel.allocation import expert_tp_size

__all__ = [
    "ATTENTION_BACKENDS",
    "TEStatus",
    "TEUnusableError",
    "AttentionChoice",
    "probe_te",
    "have_te",
    "select_attention",
    "resolve_attention",
    "attn_backend_enum",
    "committed_attention_backend",
    "config_attention_backend",
    "decide_fusions",
    "runtime_config_fields",
    "apex_grad_accum_available",
]

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


class TEUnusableError(RuntimeError):
    """TransformerEngine is installed but cannot be imported, or is needed and missing."""


@dataclass(frozen=True)
class TEStatus:
    """Result of probing TransformerEngine: ``state`` is ``"ok"``, ``"missing"`` or
    ``"broken"``; ``version`` is set when ok, ``error`` (the import error) when broken."""

    state: str
    version: Optional[str] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.state == "ok"


def probe_te() -> TEStatus:
    """Try to import ``transformer_engine`` (and its PyTorch extension).

    ``missing`` only when no ``transformer_engine`` module exists at all; any exception raised
    while importing an installed TE (including a ``ModuleNotFoundError`` for one of *its*
    dependencies) gives ``broken`` with the error text."""
    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return TEStatus("missing")
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - any failure of an installed TE is reported
        return TEStatus("broken", error=f"{type(exc).__name__}: {exc}")
    version = getattr(te, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("transformer-engine")
        except Exception:  # noqa: BLE001 - version unknown: treat as oldest
            version = "0"
    return TEStatus("ok", version=str(version))


def _broken_message(status: TEStatus) -> str:
    return (
        "TransformerEngine is installed but fails to import "
        f"({status.error}); fix or uninstall it, or set model.attention_backend=local to "
        "build megatron's local attention without TE (per-sequence torch SDPA: slower than "
        "TE's kernels, no context parallelism)"
    )


def have_te(cuda: Optional[bool] = None) -> bool:
    """True when CUDA is available and TransformerEngine imports; False when CUDA is absent or
    TE is not installed. Raises :class:`TEUnusableError` when TE is installed but broken.

    ``cuda`` overrides ``torch.cuda.is_available()`` (tests). Without CUDA TE is not imported
    at all (its import may legitimately fail on a machine without GPU libraries)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return False
    status = probe_te()
    if status.state == "broken":
        raise TEUnusableError(_broken_message(status))
    return status.ok


@dataclass(frozen=True)
class AttentionChoice:
    """``use_te``: TE layer spec + THD packed attention (else local spec with the same
    THD parameters, see :mod:`areal_mega.models.varlen_attention`);
    ``backend``: the megatron ``AttnBackend`` name set in the TransformerConfig."""

    use_te: bool
    backend: str


def select_attention(backend: str, *, cuda: bool, te: Optional[TEStatus]) -> AttentionChoice:
    """Pure decision for ``model.attention_backend`` = ``backend``.

    * ``local``: megatron's local spec (per-sequence SDPA), on CPU or GPU; TE is not needed.
    * CPU: ``auto`` means local; ``flash`` / ``fused`` / ``unfused`` are TE kernels and are
      refused.
    * CUDA: TE must be importable (``te.ok``); ``auto`` lets TE choose among its backends, the
      others pin TE to one of them. A missing or broken TE is refused with the reason.

    ``te`` may be None when it is not needed (CPU, or ``local``)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"model.attention_backend={backend!r}: must be one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if backend == "local":
        return AttentionChoice(False, "local")
    if not cuda:
        if backend == "auto":
            return AttentionChoice(False, "local")
        raise TEUnusableError(
            f"model.attention_backend={backend!r} is a TransformerEngine "
            "kernel and needs CUDA; use auto or local on CPU"
        )
    if te is None:
        raise ValueError("select_attention needs the TE status on CUDA")
    if te.state == "broken":
        raise TEUnusableError(_broken_message(te))
    if te.state == "missing":
        raise TEUnusableError(
            f"model.attention_backend={backend!r}: CUDA is available but TransformerEngine is "
            "not installed; install transformer-engine[pytorch], or set "
            "model.attention_backend=local to run megatron's local attention (per-sequence "
            "torch SDPA: slower than TE's kernels, no context parallelism)"
        )
    return AttentionChoice(True, backend)


def resolve_attention(backend: str = "auto") -> AttentionChoice:
    """:func:`select_attention` with the facts of this process (TE probed only when needed)."""
    cuda = torch.cuda.is_available()
    te = probe_te() if cuda and backend != "local" else None
    return select_attention(backend, cuda=cuda, te=te)


def attn_backend_enum(name: str):
    """megatron's ``AttnBackend`` member called ``name``."""
    from megatron.core.transformer.enums import AttnBackend

    try:
        return AttnBackend[name]
    except KeyError:
        raise ValueError(
            f"model.attention_backend={name!r}: must be one of {', '.join(ATTENTION_BACKENDS)}"
        ) from None


_ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_ENV_TO_BACKEND = {
    ("0", "0", "0"): "local",
    ("1", "0", "0"): "flash",
    ("0", "1", "0"): "fused",
    ("0", "0", "1"): "unfused",
    ("1", "1", "1"): "auto",
}


def committed_attention_backend() -> Optional[str]:
    """The attention backend this process already committed to (None if none yet).

    megatron-core's ``LanguageModule`` writes its ``AttnBackend`` into the process-global
    ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` variables and asserts
    that every later model of the process agrees."""
    vals = tuple(os.environ.get(k) for k in _ENV_VARS)
    if all(v is None for v in vals):
        return None
    return _ENV_TO_BACKEND.get(tuple(v or "1" for v in vals), "auto")


def config_attention_backend(requested: Optional[str], use_te: bool) -> str:
    """The ``AttnBackend`` name to put in a TransformerConfig.

    TE builds use ``requested`` (megatron then pins TE's kernel through the NVTE variables).
    A local-spec build ignores the value for computing, so it reuses what the process already
    committed to (a meta-device converter model next to a TE engine must not trip megatron's
    one-backend-per-process assertion), else ``requested`` or ``local``. ``requested`` None:
    the committed backend, else ``auto``."""
    committed = committed_attention_backend()
    if requested is None:
        return committed or "auto"
    if not use_te and committed is not None:
        return committed
    return requested


# ------------------------------------------------------------------------------- fusions
def apex_grad_accum_available() -> bool:
    """True when apex's ``fused_weight_gradient_mlp_cuda`` extension imports (megatron's own
    ``ColumnParallelLinear``, e.g. the output layer, needs it for gradient-accumulation
    fusion, with or without TE)."""
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        return False
    try:
        importlib.import_module("fused_weight_gradient_mlp_cuda")
    except Exception:  # noqa: BLE001 - a broken extension is simply not used
        return False
    return True


def _version_tuple(v: Optional[str]) -> tuple:
    out = []
    for part in (v or "0").split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) or "0"
        out.append(int(digits))
    return tuple(out + [0] * (3 - len(out)))


def decide_fusions(
    *,
    cuda: bool,
    use_te: bool,
    te_version: Optional[str],
    apex_grad_accum: bool,
    activation: str = "silu",
    gated_linear_unit: bool = True,
    cp: int = 1,
) -> dict:
    """Pure decision of the three GPU fusions for a TransformerConfig.

    * ``apply_rope_fusion``: TE's fused RoPE (megatron-core calls TE's
      ``apply_rotary_pos_emb(..., fused=True)``, sbhd and thd); needs TE >= 1.4, and >= 1.12
      for THD with context parallelism. The unfused THD path does a host sync per layer.
    * ``bias_activation_fusion``: megatron-core's own fused SwiGLU (``bias_swiglu_impl``), so
      only CUDA and a gated SiLU MLP are needed.
    * ``gradient_accumulation_fusion``: wgrad GEMMs accumulate into ``main_grad``; megatron's
      ``ColumnParallelLinear`` (the output layer) requires apex's
      ``fused_weight_gradient_mlp_cuda`` for it, so it is on only when that imports.

    Everything is off on CPU."""
    if not cuda:
        return dict(
            apply_rope_fusion=False,
            bias_activation_fusion=False,
            gradient_accumulation_fusion=False,
        )
    te_v = _version_tuple(te_version) if use_te else (0, 0, 0)
    rope = use_te and te_v >= (1, 4, 0) and (cp == 1 or te_v >= (1, 12, 0))
    return dict(
        apply_rope_fusion=bool(rope),
        bias_activation_fusion=activation == "silu" and gated_linear_unit,
        gradient_accumulation_fusion=bool(apex_grad_accum),
    )


#: the engine's dtype names -> torch dtypes
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def runtime_config_fields(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    sequence_parallel: bool = False,
    dtype: str = "fp32",
    variable_seq_lengths: bool = True,
    use_te: bool = False,
    deterministic: bool = False,
    attention_backend: Optional[str] = None,
    fusions: Optional[dict] = None,
    activation: str = "silu",
) -> dict:
    """The ``TransformerConfig`` fields the engine decides, whatever the architecture: parallel
    sizes of our mesh, dtype, CPU/GPU fusions (:func:`~areal_mega.models.backend.decide_fusions`
    unless ``fusions`` is given), the MoE dispatcher, initialisation on CPU, attention backend
    (see :func:`~areal_mega.models.builder.transformer_config_from_hf`)."""
    params_dtype = _DTYPES[dtype]
    on_gpu = torch.cuda.is_available()
    if fusions is None:
        te = probe_te() if on_gpu and use_te else None
        fusions = decide_fusions(
            cuda=on_gpu,
            use_te=use_te,
            te_version=te.version if te is not None else None,
            apex_grad_accum=on_gpu and apex_grad_accum_available(),
            activation=activation,
            gated_linear_unit=True,
            cp=cp,
        )
    return dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp_size(tp, etp),
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        variable_seq_lengths=variable_seq_lengths,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        masked_softmax_fusion=on_gpu and use_te,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        deterministic_mode=deterministic,
        attention_backend=attn_backend_enum(config_attention_backend(attention_backend, use_te)),
        **fusions,
    )

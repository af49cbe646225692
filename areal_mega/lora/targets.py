"""Which linears get LoRA adapters, in HF PEFT names and Megatron-Bridge's canonical names (pure).

Users name targets as PEFT does (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``, or ``all-linear``); Megatron-Bridge's canonical LoRA names the same
projections inside Megatron's fused linears (``linear_q`` … ``linear_fc2``). Either spelling is
accepted. :func:`check_lora_support` refuses what this implementation does not serve, before any
model is built, with the reason.
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = [
    "HF_TO_CANONICAL",
    "CANONICAL_TO_HF",
    "ATTENTION_TARGETS",
    "MLP_TARGETS",
    "POST_NORM_PROJECTION_MODEL_TYPES",
    "NO_LORA",
    "canonical_targets",
    "hf_targets",
    "check_lora_support",
    "VL_LORA_FAMILIES",
    "check_vision_language_lora",
    "LoraSupportError",
    "lora_server_flags",
]

#: PEFT module name -> Megatron-Bridge canonical LoRA target, in the order PEFT lists them
HF_TO_CANONICAL = {
    "q_proj": "linear_q",
    "k_proj": "linear_k",
    "v_proj": "linear_v",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1_gate",
    "up_proj": "linear_fc1_up",
    "down_proj": "linear_fc2",
}
CANONICAL_TO_HF = {v: k for k, v in HF_TO_CANONICAL.items()}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
#: families whose attention output and MLP down projections end in the sublayer's post-norm
#: (areal_mega/models/gemma3.py, RowParallelLinearWithPostNorm): the bridge's adapter wrapper
#: adds the adapter's output to the wrapped module's, i.e. after the norm, where PEFT adds it
#: inside o_proj / down_proj, before the norm
POST_NORM_PROJECTION_MODEL_TYPES = ("exaone4", "gemma2", "gemma3_text")
#: families LoRA does not serve at all, and why
NO_LORA = {
    "gemma4_text": (
        "its layers' fused QKV differs by layer (a full layer's global head size, K = V "
        "layers without v rows, key/value-shared layers with the queries alone), which the "
        "adapters' one q/k/v split of linear_qkv does not follow, and the per-layer-input "
        "linears have no adapters; train without LoRA"
    ),
}


class LoraSupportError(ValueError):
    """A LoRA setting, model family or layout this implementation does not serve."""


def hf_targets(target_modules: Sequence[str]) -> List[str]:
    """``target_modules`` (PEFT or canonical names, or ``all-linear``) as PEFT names, in PEFT's
    order, without duplicates. Raises :class:`LoraSupportError` naming an unknown module."""
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if not target_modules:
        raise LoraSupportError(
            "lora.target_modules: empty; name at least one of "
            f"{', '.join(HF_TO_CANONICAL)} (or all-linear)"
        )
    wanted = set()
    for t in target_modules:
        if t == "all-linear":
            wanted.update(HF_TO_CANONICAL)
        elif t in HF_TO_CANONICAL:
            wanted.add(t)
        elif t in CANONICAL_TO_HF:
            wanted.add(CANONICAL_TO_HF[t])
        else:
            raise LoraSupportError(
                f"lora.target_modules: {t!r} is not a linear this model has; known: "
                f"{', '.join(HF_TO_CANONICAL)}, all-linear (or the canonical names "
                f"{', '.join(CANONICAL_TO_HF)})"
            )
    return [t for t in HF_TO_CANONICAL if t in wanted]


def canonical_targets(target_modules: Sequence[str]) -> List[str]:
    """The canonical LoRA targets of ``target_modules`` (see :func:`hf_targets`)."""
    return [HF_TO_CANONICAL[t] for t in hf_targets(target_modules)]


def check_lora_support(
    *,
    model_type: str,
    is_moe: bool,
    is_mla: bool,
    targets: Sequence[str],
    rank: int,
    tp: int,
    cp: int,
    critic: bool = False,
    gated_mlp: bool = True,
    linear_attention: bool = False,
    hybrid: bool = False,
    vision_language: bool = False,
) -> None:
    """Refuse LoRA settings this implementation does not serve (pure; raises
    :class:`LoraSupportError` with the reason and what to do instead).

    ``targets``: PEFT names (:func:`hf_targets`). Refused: rank < 1; a rank not divisible by the
    tensor-parallel size (the adapters' rank dimension is split over TP); multi-latent attention
    (DeepSeek-V3: its projections have no q/k/v/o LoRA mapping); MLP targets on MoE models (the
    routed experts' adapters have no PEFT naming SGLang loads); gate / up targets on an MLP
    without a gate (``gated_mlp`` False: Nemotron's squared ReLU, whose ``linear_fc1`` is the up
    projection alone, not the ``[gate; up]`` the adapters split); o_proj / down_proj targets
    of :data:`POST_NORM_PROJECTION_MODEL_TYPES` (the post-norm sits inside those modules, the
    adapter would add after it); models with gated delta-net layers (``linear_attention``:
    Qwen3-Next, Qwen3.5); context parallelism (its
    equality with one rank is not tested for adapters); a LoRA critic; a hybrid model
    (``hybrid``: Nemotron-H's Mamba layers, whose mixer projections have no adapters and whose
    attention / MLP layers' adapters are not tested there); a vision-language model other than
    :data:`VL_LORA_FAMILIES` (``vision_language``: :func:`check_vision_language_lora`); the
    families of :data:`NO_LORA` (Gemma 4 text), naming why."""
    if rank < 1:
        raise LoraSupportError(f"lora.rank={rank}: must be >= 1")
    if model_type in NO_LORA:
        raise LoraSupportError(f"LoRA on {model_type}: not supported: {NO_LORA[model_type]}")
    if vision_language:
        check_vision_language_lora(model_type)
    if hybrid:
        raise LoraSupportError(
            f"LoRA on {model_type}: hybrid (Mamba) models are not supported (the Mamba "
            "mixers' projections have no adapters); train without LoRA"
        )
    if rank % tp:
        raise LoraSupportError(
            f"lora.rank={rank} with tensor parallel size {tp}: the rank must "
            "be a multiple of TP (the adapters' A matrices are split on it)"
        )
    if linear_attention:
        raise LoraSupportError(
            f"LoRA on {model_type}: its gated delta-net (linear-attention) layers have no "
            "q/k/v/o projections to adapt and its attention's fused QKV holds an output gate "
            "the adapters' layout lacks; not supported"
        )
    if is_mla:
        raise LoraSupportError(
            f"LoRA on {model_type}: multi-latent attention has no q/k/v/o "
            "projections to adapt; not supported"
        )
    mlp = [t for t in targets if t in MLP_TARGETS]
    if is_moe and mlp:
        raise LoraSupportError(
            f"LoRA on {model_type} (MoE): lora.target_modules {mlp} would adapt the routed "
            "experts, which is not supported; target the attention only "
            f"({', '.join(ATTENTION_TARGETS)})"
        )
    fc1 = [t for t in targets if t in ("gate_proj", "up_proj")]
    if not gated_mlp and fc1:
        raise LoraSupportError(
            f"LoRA on {model_type}: its MLP has no gate (one up projection), so "
            f"lora.target_modules {fc1} are not supported; target the attention and "
            "down_proj"
        )
    post = [t for t in targets if t in ("o_proj", "down_proj")]
    if model_type in POST_NORM_PROJECTION_MODEL_TYPES and post:
        raise LoraSupportError(
            f"LoRA on {model_type}: its o_proj / down_proj end in the post-norm, after which "
            f"the adapters would add (PEFT adds them before), so lora.target_modules {post} "
            "are not supported; target q/k/v and gate/up"
        )
    if cp > 1:
        raise LoraSupportError(f"LoRA with context parallel size {cp}: not supported; use c=1")
    if critic:
        raise LoraSupportError(
            "LoRA with critic.enabled: the critic trains all its weights; "
            "not supported with lora.enabled"
        )


#: vision-language families whose language model takes adapters (the vision tower frozen)
VL_LORA_FAMILIES = ("qwen3_vl",)


def check_vision_language_lora(model_type: str) -> None:
    """Refuse LoRA on a vision-language ``model_type`` other than :data:`VL_LORA_FAMILIES`
    (:class:`LoraSupportError` naming why). Qwen2.5-VL's adapters would be named after its
    checkpoint (the bridge's table: ``model.layers.N.self_attn.q_proj``, which transformers
    renames on load), not after the modules PEFT adapts in transformers' model
    (``model.language_model.layers.N.self_attn.q_proj``)."""
    if model_type in VL_LORA_FAMILIES:
        return
    raise LoraSupportError(
        f"LoRA on {model_type} (vision-language): not supported. The adapters' PEFT names "
        "come from the bridge's checkpoint table, which names the language model's tensors "
        "as the checkpoint stores them (model.layers.N.self_attn.q_proj; transformers renames "
        "them on load), not as the modules PEFT adapts in transformers' model "
        "(model.language_model.layers.N.self_attn.q_proj): PEFT would load none of them. "
        f"LoRA on vision-language models: {', '.join(VL_LORA_FAMILIES)}; or train without "
        "LoRA (model.freeze_vision trains the language model and the projector)"
    )


def lora_server_flags(cfg) -> list:
    """The rollout servers' flags for a LoRA run that syncs adapters (SGLang's spelling, which
    the CPU server shares): LoRA on, the adapters' rank and target modules. Empty otherwise
    (full weights or merged adapters need nothing)."""
    lo = cfg.lora
    if not lo.enabled or lo.sync != "adapter":
        return []
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(lo.rank),
        "--lora-target-modules",
        *hf_targets(lo.target_modules),
    ]

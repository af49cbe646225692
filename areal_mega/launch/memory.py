"""Per-GPU memory estimate for a Megatron trainer layout (pure arithmetic, no torch).

    hp = KNOWN_MODELS["qwen2.5-7b"]
    est = estimate_memory(hp, ParallelDims(dp=4, tp=2), dtype="bf16",
                          use_distributed_optimizer=True, tokens_per_mb=8192, recompute=None)
    print(est.format())

The model (Megatron mixed precision, Korthikanti et al. 2022 style accounting):

- parameters on the worst GPU: ``ceil(L / pp)`` layers + the vocabulary matrix (input
  embedding on the first stage, output layer on the last; both when ``pp == 1`` and untied).
  Matmul weights are split by ``tp``; norms and the MoE router are replicated; expert weights
  are split by ``ep · tp`` (expert tensor parallel = tp, the megatron-core default).
- bytes per parameter, bf16/fp16: weights 2 + fp32 gradients 4 + optimizer 12 (fp32 master, Adam
  m and v), the optimizer part divided by the data-parallel shard group with the distributed
  optimizer (dense: d·c; experts: d·c/e), i.e. ``6 + 12/(d·c)``. fp32: ``4 + 4 + 8/(d·c)``.
- activations, per token of a micro-batch (``tokens_per_mb / cp`` tokens per GPU), per layer,
  2 bytes each (4 for fp32): 4·h hidden-sized tensors (split by tp only with sequence
  parallelism), Q, K, V and the attention output (flash attention: no s² scores), 4·ffn for
  SwiGLU (2·ffn for an MLP without a gate; split by tp);
  MoE layers hold ``topk`` dispatched copies (h + 4·moe_ffn, split by tp) and fp32 router logits.
  Full recompute keeps only each layer's input (+ one layer's working set). 1F1B keeps ``pp``
  micro-batches in flight on the first stage, so a stage holds ``ceil(L/pp) · pp`` layer-sets.
- logits: ``tokens · V / tp`` elements × 4 bytes (bf16 logits + their gradient; fp32: 8), last
  stage.
- a fixed ``overhead_bytes`` (CUDA context, NCCL buffers, allocator slack).
- ``reference``: a separate reference model (``ref.enabled`` without LoRA) on the trainer GPUs,
  its weights only (same layout, no gradients or optimizer).
- LoRA (``lora_rank`` > 0, :func:`lora_param_counts`): the base is frozen, so gradients and the
  optimizer hold the adapters alone (same bytes per parameter as above); the adapters add their
  weights; the reference is the actor with its adapters off (free). Activations are unchanged
  (the backward still runs through every layer; the adapters' ``[tokens, r]`` are negligible).
- a vision tower (``vision_depth`` > 0, Qwen2.5-VL's or Qwen3-VL's;
  :func:`vision_param_counts`): whole on every tensor-parallel rank of the first pipeline
  stage (the bridge builds transformers' modules, not split); its image tokens are among the
  micro-batch's tokens, each one ``merge²`` patches through the tower
  (``image_tokens_per_mb``, default every token of the micro-batch: an upper bound). A
  training tower keeps every block's activations (4·vh + 4·vh + 4·vi per patch; megatron's
  recompute does not reach transformers' modules; flash attention); ``freeze_vision`` keeps
  none of them (no gradients, no optimizer state), only one block's working set and the
  projector's input (which trains; Qwen3-VL's deepstack mergers too).

It is an upper-bound planning number, not a measurement: compare with ``cluster.gpu_memory_gb``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_mega.config import ConfigError, ModelHParams
from areal_mega.lora.targets import LoraSupportError, hf_targets
from areal_mega.parallel.allocation import ParallelDims

GiB = 1024**3
DEFAULT_OVERHEAD_BYTES = 3 * GiB  # CUDA context + NCCL + allocator fragmentation, on GPUs

# Published config.json values (Hugging Face model cards); no downloads needed.
KNOWN_MODELS: dict[str, ModelHParams] = {
    "qwen2.5-1.5b": ModelHParams(
        hidden_size=1536,
        num_layers=28,
        num_attention_heads=12,
        num_kv_heads=2,
        ffn_hidden_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "qwen2.5-7b": ModelHParams(
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_kv_heads=4,
        ffn_hidden_size=18944,
        vocab_size=152064,
        qkv_bias=True,
    ),
    "qwen2.5-32b": ModelHParams(
        hidden_size=5120,
        num_layers=64,
        num_attention_heads=40,
        num_kv_heads=8,
        ffn_hidden_size=27648,
        vocab_size=152064,
        qkv_bias=True,
    ),
    # the language model of Qwen2.5-7B + the vision tower (vision_config of the model card)
    "qwen2.5-vl-7b": ModelHParams(
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_kv_heads=4,
        ffn_hidden_size=18944,
        vocab_size=152064,
        qkv_bias=True,
        vision_depth=32,
        vision_hidden_size=1280,
        vision_intermediate_size=3420,
        vision_patch_dim=3 * 2 * 14 * 14,
        vision_merge_size=2,
    ),
    # the language model of Qwen3-8B + Qwen3-VL's vision tower (config.json of the model card)
    "qwen3-vl-8b": ModelHParams(
        hidden_size=4096,
        num_layers=36,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=12288,
        vocab_size=151936,
        qk_norm=True,
        vision_family="qwen3_vl",
        vision_depth=27,
        vision_hidden_size=1152,
        vision_intermediate_size=4304,
        vision_patch_dim=3 * 2 * 16 * 16,
        vision_merge_size=2,
        vision_position_embeddings=2304,
        vision_deepstack_layers=3,
    ),
    "qwen3-30b-a3b": ModelHParams(
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        qk_norm=True,
        num_experts=128,
        moe_ffn_hidden_size=768,
        moe_topk=8,
    ),
}

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: PEFT projection -> (input size, output size, row-parallel base) from (h, q, kv, ffn) widths
_LORA_PROJ = {
    "q_proj": (0, 1, False),
    "k_proj": (0, 2, False),
    "v_proj": (0, 2, False),
    "o_proj": (1, 0, True),
    "gate_proj": (0, 3, False),
    "up_proj": (0, 3, False),
    "down_proj": (3, 0, True),
}
_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # V·h
    output: int  # V·h, 0 when tied
    attention: int  # per layer, matmuls (+ qkv bias)
    dense_mlp: int  # per layer (0 for MoE layers)
    experts: int  # per layer, all experts
    shared_expert: int  # per layer
    replicated: int  # per layer: norms, qk-norm, router
    num_layers: int
    moe_topk: int
    num_experts: int
    final_norm: int = 0
    vision_tower: int = 0  # patch embedding + blocks (what model.freeze_vision freezes)
    vision_merger: int = 0  # the projector into the language model

    @property
    def per_layer(self) -> int:
        return self.attention + self.dense_mlp + self.experts + self.shared_expert + self.replicated

    @property
    def vision(self) -> int:
        return self.vision_tower + self.vision_merger

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.output
            + self.num_layers * self.per_layer
            + self.final_norm
            + self.vision
        )

    @property
    def active(self) -> int:
        """Parameters used per token (MoE: ``topk`` of the experts)."""
        per_expert = self.experts // self.num_experts if self.num_experts else 0
        dense_layer = self.per_layer - self.experts + per_expert * self.moe_topk
        return (
            self.embedding
            + self.output
            + self.num_layers * dense_layer
            + self.final_norm
            + self.vision
        )


def vision_param_counts(hp: ModelHParams) -> tuple[int, int]:
    """``(tower, merger)`` parameters of a vision tower (0, 0 for a text model).

    Qwen2.5-VL (``vision_family``): the patch embedding (a bias-free convolution,
    ``patch_dim · vh``); per block QKV and the output projection with biases, a SwiGLU MLP
    with biases and two RMSNorms; the merger's RMSNorm and its two-layer MLP over ``merge²``
    concatenated patches into the language model's width.

    Qwen3-VL: the patch embedding with a bias and the learnt position grid
    (``vision_position_embeddings · vh``); per block QKV and output projection with biases, a
    two-layer GELU MLP with biases and two LayerNorms (weight and bias); the merger (LayerNorm
    over ``vh``) and one deepstack merger per ``vision_deepstack_layers`` (LayerNorm over the
    ``merge² · vh`` concatenation), each a two-layer MLP into the language model's width."""
    if not hp.vision_depth:
        return 0, 0
    vh, vi, h = hp.vision_hidden_size, hp.vision_intermediate_size, hp.hidden_size
    if not (vh and vi and hp.vision_patch_dim):
        raise ConfigError(
            "model_hparams.vision_depth > 0 needs vision_hidden_size, vision_intermediate_size "
            "and vision_patch_dim"
        )
    attention = (3 * vh * vh + 3 * vh) + (vh * vh + vh)
    m = vh * hp.vision_merge_size**2
    projector = (m * m + m) + (m * h + h)
    if hp.vision_family == "qwen3_vl":
        block = attention + (vh * vi + vi) + (vi * vh + vh) + 2 * 2 * vh
        tower = (
            hp.vision_patch_dim * vh
            + vh
            + hp.vision_position_embeddings * vh
            + hp.vision_depth * block
        )
        merger = (2 * vh + projector) + hp.vision_deepstack_layers * (2 * m + projector)
        return tower, merger
    block = attention + 2 * (vh * vi + vi) + (vi * vh + vh) + 2 * vh
    tower = hp.vision_patch_dim * vh + hp.vision_depth * block
    merger = vh + projector
    return tower, merger


def count_params(hp: ModelHParams) -> ParamCounts:
    """Parameter counts of a Llama/Qwen-style decoder (SwiGLU or a plain MLP, RMSNorm, GQA,
    optional MoE)."""
    h = hp.hidden_size
    heads = hp.num_attention_heads
    kv = hp.num_kv_heads or heads
    hd = hp.head_dim or h // heads
    q, k = heads * hd, kv * hd
    attention = h * q + 2 * h * k + q * h + ((q + 2 * k) if hp.qkv_bias else 0)
    norm = 2 * h if hp.norm_bias else h
    replicated = 2 * norm + (2 * hd if hp.qk_norm else 0)
    if hp.num_experts:
        dense_mlp = 0
        experts = hp.num_experts * 3 * h * hp.moe_ffn_hidden_size
        shared = 3 * h * hp.shared_expert_ffn_hidden_size
        replicated += h * hp.num_experts  # router
    else:
        dense_mlp, experts, shared = (3 if hp.gated_mlp else 2) * h * hp.ffn_hidden_size, 0, 0
    emb = hp.vocab_size * h
    tower, merger = vision_param_counts(hp)
    return ParamCounts(
        embedding=emb,
        output=0 if hp.tie_word_embeddings else emb,
        attention=attention,
        dense_mlp=dense_mlp,
        experts=experts,
        shared_expert=shared,
        replicated=replicated,
        num_layers=hp.num_layers,
        moe_topk=hp.moe_topk,
        num_experts=hp.num_experts,
        final_norm=norm,
        vision_tower=tower,
        vision_merger=merger,
    )


def lora_param_counts(
    hp: ModelHParams, rank: int, targets, tp: int = 1, layers: Optional[int] = None
) -> tuple[int, float]:
    """``(adapter parameters of the whole model, of one TP rank over ``layers`` layers)`` for
    LoRA of ``rank`` on the PEFT ``targets``: each targeted projection of each layer has
    ``A [r, in]`` and ``B [out, r]``. Column-parallel bases (q/k/v, gate/up) split both by
    ``tp``; row-parallel ones (o, down) split ``A`` on its input and keep ``B`` whole.
    ``layers``: default all. Raises ``ConfigError`` for an unknown target or MLP targets on an
    MoE model (expert MLPs take no adapters)."""
    if rank < 1:
        raise ConfigError(f"lora.rank={rank}: must be >= 1")
    h = hp.hidden_size
    hd = hp.head_dim or h // hp.num_attention_heads
    widths = (
        h,
        hp.num_attention_heads * hd,
        (hp.num_kv_heads or hp.num_attention_heads) * hd,
        hp.ffn_hidden_size,
    )
    full = per_rank = 0.0
    for t in targets:
        if t not in _LORA_PROJ:
            raise ConfigError(f"lora.target_modules: {t!r} is not one of {sorted(_LORA_PROJ)}")
        if t in _MLP_PROJ and hp.num_experts:
            raise ConfigError(
                f"lora.target_modules: {t!r} on an MoE model (expert MLPs take "
                "no LoRA adapters; target attention only)"
            )
        i, o, row = _LORA_PROJ[t]
        n_in, n_out = widths[i], widths[o]
        full += rank * (n_in + n_out)
        per_rank += rank * n_in / tp + rank * n_out / (1 if row else tp)
    n_layers = hp.num_layers if layers is None else layers
    return int(full * hp.num_layers), per_rank * n_layers


def lora_estimate_args(lora_cfg) -> dict:
    """The :func:`estimate_memory` keywords of a ``lora`` config section (none when off)."""
    if lora_cfg is None or not lora_cfg.enabled:
        return {}
    try:
        targets = hf_targets(lora_cfg.target_modules)
    except LoraSupportError as e:
        raise ConfigError(str(e)) from None
    return {"lora_rank": int(lora_cfg.rank), "lora_targets": targets}


def fmt_bytes(n: float) -> str:
    """``12.34 GiB`` / ``5.6 MiB`` / ``12 KiB``."""
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size or unit == "KiB":
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def fmt_count(n: float) -> str:
    """``7.62B`` / ``392.6K``."""
    for suffix, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{suffix}" if suffix == "B" else f"{n / size:.1f}{suffix}"
    return str(int(n))


@dataclass
class MemoryEstimate:
    """Bytes per GPU on the most loaded trainer GPU, by category."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    overhead: float
    params_per_gpu: int
    layers_per_stage: int
    total_params: int
    active_params: int
    notes: list = field(default_factory=list)
    reference: float = 0.0  # a separate reference model's weights
    lora_rank: int = 0  # 0: full training
    trainable_params: int = 0  # LoRA: adapter parameters of the whole model
    trainable_per_gpu: int = 0

    _KEYS = ("weights", "grads", "optimizer", "activations", "logits", "overhead")

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + self.logits
            + self.overhead
            + self.reference
        )

    def as_gib(self) -> dict:
        keys = self._KEYS + ("reference", "total")
        return {k: round(getattr(self, k) / GiB, 2) for k in keys}

    def format(self, capacity_gb: Optional[float] = None, unit: str = "GPU") -> str:
        keys = self._KEYS + (("reference",) if self.reference else ())
        parts = " | ".join(f"{k} {fmt_bytes(getattr(self, k))}" for k in keys)
        lines = [
            f"  model: {fmt_count(self.total_params)} params ({fmt_count(self.active_params)}"
            f" active); this {unit} holds {fmt_count(self.params_per_gpu)} params, "
            f"{self.layers_per_stage} layers"
        ]
        if self.lora_rank:
            lines.append(
                f"  LoRA r={self.lora_rank}: {fmt_count(self.trainable_params)} "
                f"trainable params ({fmt_count(self.trainable_per_gpu)} on this {unit}); "
                "the frozen base has no gradients or optimizer state; the reference "
                "is the actor with its adapters off"
            )
        lines += [f"  {parts}", f"  total {fmt_bytes(self.total)} per {unit}"]
        if capacity_gb:
            pct = 100.0 * self.total / (capacity_gb * GiB)
            verdict = "fits" if pct <= 100 else "DOES NOT FIT"
            lines[-1] += f" of {capacity_gb:g} GiB ({pct:.0f}%, {verdict})"
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def estimate_memory(
    hp: ModelHParams,
    dims: ParallelDims,
    dtype: str = "bf16",
    use_distributed_optimizer: bool = True,
    tokens_per_mb: int = 8192,
    recompute: Optional[str] = None,
    sequence_parallel: Optional[bool] = None,
    overhead_bytes: float = DEFAULT_OVERHEAD_BYTES,
    reference: bool = False,
    lora_rank: int = 0,
    lora_targets=(),
    freeze_vision: bool = False,
    image_tokens_per_mb: Optional[int] = None,
) -> MemoryEstimate:
    """Per-GPU memory of the most loaded trainer GPU (see the module docstring).
    ``reference``: a separate reference model shares the GPUs (ignored with LoRA, whose
    reference is free); ``lora_rank`` > 0: LoRA on the PEFT ``lora_targets``.
    A vision-language model: ``freeze_vision`` (``model.freeze_vision``: the tower trains
    not, the projector does); ``image_tokens_per_mb``: image tokens of a micro-batch (None:
    all ``tokens_per_mb``, the upper bound)."""
    if dtype not in _BYTES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(_BYTES)}")
    if recompute not in (None, "full", "selective"):
        raise ValueError(f"recompute={recompute!r}: must be None, 'full' or 'selective'")
    c = count_params(hp)
    tp, pp, cp, ep = dims.tp, dims.pp, dims.cp, dims.ep
    sp = (tp > 1) if sequence_parallel is None else sequence_parallel
    lps = math.ceil(hp.num_layers / pp)
    vocab_on_stage = c.embedding + c.output if pp == 1 else c.embedding  # first or last stage
    dense = lps * (c.attention + c.dense_mlp + c.shared_expert) + vocab_on_stage
    dense_gpu = dense / tp + lps * c.replicated
    expert_gpu = lps * c.experts / (ep * dims.expert_tp)
    # the vision tower and projector: whole on each TP rank of the first stage
    vision_gpu = c.vision
    vision_trained = c.vision_merger if freeze_vision else c.vision
    params_gpu = dense_gpu + expert_gpu + vision_gpu

    w = _BYTES[dtype]
    if dtype == "fp32":
        grad_b, opt_b = 4, 8  # Adam m, v (weights are the master copy)
    else:
        grad_b, opt_b = 4, 12  # fp32 main grads; fp32 master + m + v
    dense_shard = dims.dp * cp if use_distributed_optimizer else 1
    expert_shard = max(1, dims.expert_dp) if use_distributed_optimizer else 1
    optimizer = opt_b * ((dense_gpu + vision_trained) / dense_shard + expert_gpu / expert_shard)
    grads = grad_b * (params_gpu - vision_gpu + vision_trained)
    ref_bytes = w * params_gpu if reference and not lora_rank else 0.0
    lora_full = lora_gpu = 0
    if lora_rank:
        lora_full, lora_gpu = lora_param_counts(hp, lora_rank, lora_targets, tp, lps)
        grads = grad_b * lora_gpu
        optimizer = opt_b * lora_gpu / dense_shard
        params_gpu += lora_gpu

    h = hp.hidden_size
    heads = hp.num_attention_heads
    hd = hp.head_dim or h // heads
    q, k = heads * hd, (hp.num_kv_heads or heads) * hd
    tokens = tokens_per_mb / cp
    hidden_terms = 4 * h / (tp if sp else 1)
    attn_terms = (2 * q + 2 * k) / tp
    if hp.num_experts:
        mlp_terms = (
            hp.moe_topk * (h + 4 * hp.moe_ffn_hidden_size) / tp
            + 4 * hp.shared_expert_ffn_hidden_size / tp
        )
        router_bytes = 4 * hp.num_experts  # fp32 router logits / probabilities
    else:
        # SwiGLU keeps [gate; up] and their product; a plain MLP its input and activation
        mlp_terms, router_bytes = (4 if hp.gated_mlp else 2) * hp.ffn_hidden_size / tp, 0
    act_b = w  # activations are kept in the compute dtype
    layer_bytes = tokens * (act_b * (hidden_terms + attn_terms + mlp_terms) + router_bytes)
    notes = []
    if recompute == "full":
        kept = tokens * act_b * h / (tp if sp else 1)
        activations = lps * pp * kept + layer_bytes
        notes.append("full recompute: each layer keeps its input; one layer's working set")
    else:
        activations = lps * pp * layer_bytes
        if recompute == "selective":
            notes.append("selective recompute saves little beyond flash attention here")
    if c.vision:
        vh, vi = hp.vision_hidden_size, hp.vision_intermediate_size
        image_tokens = tokens_per_mb if image_tokens_per_mb is None else image_tokens_per_mb
        patches = image_tokens / cp * hp.vision_merge_size**2
        block_bytes = patches * act_b * (4 * vh + 4 * vh + 4 * vi)
        # each merger (Qwen3-VL: and its deepstack mergers) keeps its input and its output
        mergers = 1 + (hp.vision_deepstack_layers if hp.vision_family == "qwen3_vl" else 0)
        merger_bytes = mergers * image_tokens / cp * act_b * (2 * vh * hp.vision_merge_size**2 + h)
        kept_blocks = 0 if freeze_vision else hp.vision_depth
        # 1F1B: the first stage holds pp micro-batches' images in flight
        activations += pp * (kept_blocks * block_bytes + merger_bytes) + block_bytes
        notes.append(
            f"vision tower: {fmt_count(c.vision_tower)} params "
            f"({'frozen' if freeze_vision else 'trained'}) + projector "
            f"{fmt_count(c.vision_merger)}, whole on every TP rank of the first stage; "
            f"{fmt_count(patches)} patches per micro-batch "
            + (
                "(every token an image token: the upper bound)"
                if image_tokens_per_mb is None
                else f"({image_tokens} image tokens)"
            )
            + (
                ""
                if freeze_vision
                else f"; its activations {fmt_bytes(pp * kept_blocks * block_bytes)} "
                "(model.freeze_vision=true keeps none)"
            )
        )
    logits = tokens * hp.vocab_size / tp * 2 * act_b
    if hp.num_layers % pp:
        notes.append(f"num_layers={hp.num_layers} is not divisible by pp={pp}")
    return MemoryEstimate(
        weights=w * params_gpu,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        overhead=overhead_bytes,
        params_per_gpu=int(params_gpu),
        layers_per_stage=lps,
        total_params=c.total + lora_full,
        active_params=c.active + lora_full,
        notes=notes,
        reference=ref_bytes,
        lora_rank=lora_rank,
        trainable_params=lora_full,
        trainable_per_gpu=int(lora_gpu),
    )


def rollout_memory(
    hp: ModelHParams,
    tp: int,
    pp: int = 1,
    gpu_memory_gb: float = 80.0,
    mem_fraction_static: float = 0.8,
    dtype: str = "bf16",
) -> dict:
    """Inference server per GPU: weights and how many KV-cache tokens the rest holds."""
    c = count_params(hp)
    weights = _BYTES.get(dtype, 2) * c.total / (tp * pp)
    hd = hp.head_dim or hp.hidden_size // hp.num_attention_heads
    kv_heads_gpu = max(1, (hp.num_kv_heads or hp.num_attention_heads) // tp)
    kv_per_token = 2 * math.ceil(hp.num_layers / pp) * kv_heads_gpu * hd * 2
    pool = max(0.0, mem_fraction_static * gpu_memory_gb * GiB - weights)
    return {
        "weights_gib": round(weights / GiB, 2),
        "kv_cache_gib": round(pool / GiB, 2),
        "kv_tokens": int(pool // kv_per_token),
    }


def hparams_from_hf_config(path: str | Path) -> ModelHParams:
    """Read a Hugging Face ``config.json`` (Llama / Qwen2 / Qwen3 / Qwen3-MoE fields; Ernie 4.5's
    MoE names; Qwen2.5-VL: its ``text_config`` and ``vision_config``). Every layer of an MoE
    model is counted as MoE."""
    d = json.loads(Path(path).read_text())
    vision = d.get("vision_config")
    if vision is not None:
        family = d.get("model_type")
        if family not in ("qwen2_5_vl", "qwen3_vl"):
            raise ValueError(
                f"model_type {family!r} is a vision-language model whose vision tower the "
                "estimate does not count (it counts Qwen2.5-VL's and Qwen3-VL's); give the "
                "recipe a model_hparams section with the vision_* fields"
            )
        # the language model's fields: top level in older files, text_config in newer ones
        d = {**d, **(d.get("text_config") or {}), "model_type": family}
    # Nemotron-H's layer pattern, Falcon-H1's Mamba mixers beside the attention
    if d.get("layers_block_type") or d.get("hybrid_override_pattern") or d.get("mamba_n_heads"):
        raise ValueError(
            f"model_type {d.get('model_type')!r} is a hybrid (Mamba) model: the estimate "
            "counts attention + MLP decoder layers only; give the recipe a model_hparams "
            "section"
        )
    moe = int(
        d.get("num_experts")
        or d.get("num_local_experts")  # transformers 5 name
        or d.get("n_routed_experts")
        or d.get("moe_num_experts")  # Ernie 4.5
        or 0
    )
    moe_ffn = d.get("moe_intermediate_size") or 0 if moe else 0
    # Ernie 4.5: shared experts of moe_intermediate_size each
    shared = d.get("shared_expert_intermediate_size") or moe_ffn * (
        d.get("moe_num_shared_experts") or 0
    )
    return ModelHParams(
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads") or 0,
        head_dim=d.get("head_dim") or 0,
        ffn_hidden_size=d.get("intermediate_size") or 0,
        gated_mlp=d.get("hidden_act") != "relu2",
        norm_bias=d.get("model_type") == "nemotron",
        vocab_size=d["vocab_size"],
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bool(d.get("attention_bias", d.get("model_type") in ("qwen2", "qwen2_5_vl"))),
        qk_norm=d.get("model_type", "").startswith("qwen3"),
        num_experts=moe,
        moe_ffn_hidden_size=moe_ffn,
        moe_topk=d.get("num_experts_per_tok") or d.get("moe_k") or 0 if moe else 0,
        shared_expert_ffn_hidden_size=shared,
        **(_vision_hparams(vision, d["model_type"]) if vision is not None else {}),
    )


def _vision_hparams(v: dict, family: str) -> dict:
    """The ``vision_*`` fields of a Qwen2.5-VL or Qwen3-VL ``vision_config`` (transformers'
    defaults where a key is absent)."""
    qwen3 = family == "qwen3_vl"
    patch = int(v.get("patch_size", 16 if qwen3 else 14))
    out = dict(
        vision_family=family,
        vision_depth=int(v.get("depth", 27 if qwen3 else 32)),
        vision_hidden_size=int(v.get("hidden_size", 1152 if qwen3 else 1280)),
        vision_intermediate_size=int(v.get("intermediate_size", 4304 if qwen3 else 3420)),
        vision_patch_dim=int(v.get("in_channels", v.get("in_chans", 3)))
        * int(v.get("temporal_patch_size", 2))
        * patch
        * patch,
        vision_merge_size=int(v.get("spatial_merge_size", 2)),
    )
    if qwen3:
        out["vision_position_embeddings"] = int(v.get("num_position_embeddings", 2304))
        out["vision_deepstack_layers"] = len(v.get("deepstack_visual_indexes", [8, 16, 24]))
    return out


def known_model_key(model_path: str) -> Optional[str]:
    """``Qwen/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b`` when it names a model of the table."""
    name = Path(model_path.rstrip("/")).name.lower()
    for key in sorted(KNOWN_MODELS, key=len, reverse=True):
        if name.startswith(key) or name.startswith(key.replace("-a3b", "a3b")):
            return key
    return None


def resolve_hparams(cfg) -> tuple[ModelHParams, str]:
    """The model numbers for a config: ``model_hparams`` in the recipe, else
    ``<model.path>/config.json``, else the built-in table by the model path's name."""
    if cfg.model_hparams is not None:
        return cfg.model_hparams, "recipe model_hparams"
    path = Path(cfg.model.path) / "config.json" if cfg.model.path else None
    if path is not None and path.is_file():
        try:
            return hparams_from_hf_config(path), str(path)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"model.path={cfg.model.path!r}: cannot read {path}: {e}") from None
    key = known_model_key(cfg.model.path) if cfg.model.path else None
    if key:
        return KNOWN_MODELS[key], f"built-in table ({key})"
    raise ConfigError(
        f"model.path={cfg.model.path!r}: no config.json there and not a known "
        f"model ({sorted(KNOWN_MODELS)}); add a model_hparams section to the "
        "recipe for the memory estimate"
    )

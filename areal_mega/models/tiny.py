"""Tiny HF-format causal LMs with random weights and a locally built character tokenizer
(and a vision-language model, Qwen2.5-VL, with its image processor: :data:`VL_ARCHS`).

Used by the tests, the CPU demo and anyone who wants a smoke run without downloading weights.
Nothing here touches the network: the tokenizer is built with `tokenizers`, the model with
`transformers` from a config, and both are written with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_mega.models.vlm.tiny import make_tiny_vl

ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "gemma3_text",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v2",
    "gemma",
    "glm4_moe_lite",
    "hy_v3",
    "nemotron",
    "gemma2",
    "olmoe",
    "minimax_m2",
    "gpt_oss",
    "ernie4_5_moe",
    "exaone_moe",
    "exaone4",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "nemotron_h",
    "gemma4_text",
    "falcon_h1",
)
#: vision-language models (:mod:`areal_mega.models.vlm.tiny`): the text model's sizes from
#: the spec, the vision tower's from its ``vision_*`` fields
VL_ARCHS = ("qwen2_5_vl", "qwen3_vl")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARSETS = {
    # the demo's vocabulary: digits, arithmetic and separators
    "digits": "0123456789+-*=:?, \n",
    # printable ASCII for general smoke runs (math prompts, chat templates)
    "ascii": string.printable,
}
# One user turn, rendered verbatim; the generation prompt adds nothing so that the model sees
# exactly the prompt text (the tiny vocabulary has no role tokens).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass
class TinyModelSpec:
    """Sizes of a tiny model; defaults give ~0.1-0.4M parameters."""

    arch: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    charset: str = "ascii"
    seed: int = 0
    initializer_range: float = 0.02
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    sliding_window: Optional[int] = None  # mistral, gemma3_text: attention window
    # gemma3_text: layers alternate sliding / full attention (sliding first); the sliding
    # layers' RoPE base and the attention scale's denominator (None: head_dim)
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: Optional[int] = None
    # glm4_moe (DeepSeek-style routing; see areal_mega.models.moe_families); hy_v3 takes the
    # dense layers, shared experts and scaling factor (no groups)
    first_k_dense_replace: int = 1
    n_shared_experts: int = 1
    n_group: int = 2
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    partial_rotary_factor: float = 0.5
    attention_bias: bool = True
    use_qk_norm: bool = True
    expert_bias_std: float = 0.02  # e_score_correction_bias ~ N(0, std) (HF initialises 0)
    # gemma2: tanh soft-caps of the attention scores and the final logits (None: none); small
    # enough that a tiny model's scores and logits reach them
    attn_logit_softcapping: Optional[float] = 1.0
    final_logit_softcapping: Optional[float] = 2.0
    # deepseek_v3, deepseek_v2 (multi-latent attention; also the glm4_moe routing fields, of
    # which deepseek_v2's softmax router uses the expert counts and routed_scaling_factor)
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # gpt_oss: YaRN over a short original context (so that it changes the tiny model's RoPE)
    yarn_factor: float = 4.0
    yarn_original_max_position_embeddings: int = 16
    # qwen3_next: gated delta-net layers (linear attention) before every full-attention layer
    # (layer_types alternate, linear first); their key / value heads and widths
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 8
    linear_value_head_dim: int = 12
    linear_conv_kernel_dim: int = 4
    # ernie4_5_moe: layer i is MoE when (i + 1) % moe_layer_interval == 0 and i >= 1 (the
    # others dense MLPs of intermediate_size)
    moe_layer_interval: int = 1
    # qwen2_5_vl: the vision tower, and the multimodal RoPE's channels per axis (temporal,
    # height, width; None: 1 : 1.5 : 1.5 of head_dim / 2)
    vision_depth: int = 2
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_heads: int = 2
    mrope_section: Optional[tuple] = None
    # nemotron_h: one letter per layer (M Mamba-2, * attention, - MLP; the layer count is its
    # length, num_layers is not read) and the Mamba mixers' sizes; the scan chunk below the
    # sequence lengths the tests
    # pack, so that states pass between chunks. dt: transformers' torch path clamps it below
    # at time_step_min, megatron-core and transformers' CUDA path do not; the tiny model's
    # time_step_min is so small that no dt reaches it (a real checkpoint's 1e-3 may be reached,
    # and there the CPU rollout server differs from the trainer)
    hybrid_pattern: str = "M*M-"
    mamba_num_heads: int = 4
    mamba_head_dim: int = 8
    mamba_n_groups: int = 2
    ssm_state_size: int = 8
    mamba_chunk_size: int = 8
    # gemma4_text: layers alternate sliding / full (sliding first); the full layers' head size
    # and (K = V) KV heads, the last layers sharing keys / values (none by default; their MLP
    # double-wide), the per-layer inputs' width; the full layers rotate partial_rotary_factor
    # of their channels
    global_head_dim: int = 32
    num_global_kv_heads: int = 2
    attention_k_eq_v: bool = True
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = True
    hidden_size_per_layer_input: int = 8
    # gemma4_text with the MoE block in every layer (num_experts, num_experts_per_tok and
    # moe_intermediate_size above; the dense branch keeps intermediate_size)
    enable_moe_block: bool = False
    time_step_min: float = 1e-9
    # falcon_h1: Mamba-2 beside attention in every layer (the nemotron_h Mamba sizes above);
    # FalconH1Config keys: the muP multipliers away from one so that each shows (embedding,
    # lm_head, attention in / out, key, SSM in / out, the five sections of the Mamba input
    # projection z, x, B, C, dt, the MLP's gate / down); no gated Mamba norm unless this sets
    # mamba_rms_norm (transformers' default False)
    falcon_h1_config: dict = field(
        default_factory=lambda: dict(
            embedding_multiplier=1.5,
            lm_head_multiplier=0.75,
            attention_in_multiplier=0.8,
            attention_out_multiplier=1.25,
            key_multiplier=0.5,
            ssm_in_multiplier=1.1,
            ssm_out_multiplier=0.7,
            ssm_multipliers=[1.2, 0.9, 1.1, 0.8, 1.3],
            mlp_multipliers=[1.3, 0.6],
        )
    )


def build_char_tokenizer(charset: str = "ascii"):
    """A character-level `PreTrainedTokenizerFast`: ids 0..2 are <pad>, <eos>, <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if charset not in CHARSETS:
        raise ValueError(f"charset={charset!r}: must be one of {sorted(CHARSETS)}")
    chars = list(dict.fromkeys(CHARSETS[charset]))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_config(spec: TinyModelSpec, vocab_size: int, pad_id: int, eos_id: int):
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        initializer_range=spec.initializer_range,
        rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"},
        hidden_act="silu",
        attention_dropout=0.0,
    )
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    if spec.head_dim and spec.arch not in (
        "mistral",
        "qwen3",
        "qwen3_moe",
        "gemma3_text",
        "gemma",
        "hy_v3",
        "gemma2",
        "minimax_m2",
        "gpt_oss",
        "exaone_moe",
        "exaone4",
        "qwen3_next",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "gemma4_text",
        "falcon_h1",
    ):
        raise ValueError(f"head_dim: arch={spec.arch!r} derives it from hidden_size/num_heads")
    windowed = (
        "mistral",
        "gemma3_text",
        "gemma2",
        "gpt_oss",
        "exaone_moe",
        "exaone4",
        "gemma4_text",
    )
    if spec.arch not in windowed and spec.sliding_window is not None:
        raise ValueError(f"sliding_window: only the {', '.join(windowed)} tiny models have one")
    if spec.arch == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if spec.arch == "mistral":
        return MistralConfig(**common, head_dim=head_dim, sliding_window=spec.sliding_window)
    if spec.arch == "gemma3_text":
        from transformers import Gemma3TextConfig

        common.pop("hidden_act")
        layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)
        ]
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_theta},
            "full_attention": common.pop("rope_parameters"),
        }
        return Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            rope_parameters=rope,
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=spec.sliding_window or 4096,
            layer_types=layer_types,
            query_pre_attn_scalar=spec.query_pre_attn_scalar or head_dim,
        )
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.arch == "qwen3":
        return Qwen3Config(
            **common, head_dim=head_dim, attention_bias=False, use_sliding_window=False
        )
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            attention_bias=False,
            use_sliding_window=False,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
        )
    # DeepSeek-style routing (sigmoid + expert bias, groups, shared experts, dense first layers)
    routing = dict(
        n_routed_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        n_shared_experts=spec.n_shared_experts,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor,
        first_k_dense_replace=spec.first_k_dense_replace,
        norm_topk_prob=True,
    )
    if spec.arch == "glm4_moe":
        common["rope_parameters"]["partial_rotary_factor"] = spec.partial_rotary_factor
        return Glm4MoeConfig(
            **common,
            **routing,
            head_dim=spec.hidden_size // spec.num_heads,
            attention_bias=spec.attention_bias,
            use_qk_norm=spec.use_qk_norm,
        )
    if spec.arch == "glm4_moe_lite":
        from transformers import Glm4MoeLiteConfig

        common["num_key_value_heads"] = spec.num_heads
        routing.pop("first_k_dense_replace")
        k = spec.first_k_dense_replace
        return Glm4MoeLiteConfig(
            **common,
            **routing,
            mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_layers - k),
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            rope_interleave=True,
            attention_bias=False,
        )
    if spec.arch == "hy_v3":
        from transformers import HYV3Config

        k = spec.first_k_dense_replace
        return HYV3Config(
            **common,
            head_dim=head_dim,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_shared_experts=spec.n_shared_experts,
            router_scaling_factor=spec.routed_scaling_factor,
            mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_layers - k),
            attention_bias=False,
            mlp_bias=False,
        )
    if spec.arch == "deepseek_v3":
        common["num_key_value_heads"] = spec.num_heads
        return DeepseekV3Config(
            **common,
            **routing,
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            rope_interleave=True,
            attention_bias=False,
        )
    if spec.arch == "gemma":
        from transformers import GemmaConfig

        common.update(hidden_act="gelu_pytorch_tanh")
        return GemmaConfig(**common, head_dim=head_dim, attention_bias=False)
    if spec.arch == "deepseek_v2":
        from transformers import DeepseekV2Config

        common["num_key_value_heads"] = spec.num_heads
        return DeepseekV2Config(
            **common,
            n_routed_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            n_shared_experts=spec.n_shared_experts,
            first_k_dense_replace=spec.first_k_dense_replace,
            routed_scaling_factor=spec.routed_scaling_factor,
            topk_method="greedy",
            norm_topk_prob=False,
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            attention_bias=False,
        )
    if spec.arch == "olmoe":
        from transformers import OlmoeConfig

        common["intermediate_size"] = spec.moe_intermediate_size  # OLMoE: the expert width
        return OlmoeConfig(
            **common,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            norm_topk_prob=False,
            clip_qkv=None,
            attention_bias=False,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
        )
    if spec.arch in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        # the gated delta-net families: linear-attention layers first, then alternating
        gdn = dict(
            head_dim=head_dim,
            layer_types=[
                "linear_attention" if i % 2 == 0 else "full_attention"
                for i in range(spec.num_layers)
            ],
            linear_num_key_heads=spec.linear_num_key_heads,
            linear_num_value_heads=spec.linear_num_value_heads,
            linear_key_head_dim=spec.linear_key_head_dim,
            linear_value_head_dim=spec.linear_value_head_dim,
            linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        )
        common["rope_parameters"]["partial_rotary_factor"] = spec.partial_rotary_factor
    if spec.arch == "qwen3_5_text":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            **common,
            **gdn,
        )
    if spec.arch == "qwen3_5_moe_text":
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            **common,
            **gdn,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.moe_intermediate_size,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
        )
    if spec.arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **common,
            **gdn,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
        )
    if spec.arch == "minimax_m2":
        from transformers import MiniMaxM2Config

        common["intermediate_size"] = spec.moe_intermediate_size  # the expert width
        common["rope_parameters"]["partial_rotary_factor"] = spec.partial_rotary_factor
        return MiniMaxM2Config(
            **common,
            head_dim=head_dim,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
            router_jitter_noise=0.0,
        )
    if spec.arch == "ernie4_5_moe":
        from transformers import Ernie4_5_MoeConfig

        return Ernie4_5_MoeConfig(
            **common,
            use_bias=False,
            moe_num_experts=spec.num_experts,
            moe_k=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            moe_num_shared_experts=spec.n_shared_experts,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=spec.moe_layer_interval,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
        )
    # EXAONE: layers alternate sliding (rotary) / full (no rotary)
    exaone_layers = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)
    ]
    if spec.arch == "exaone4":
        from transformers import Exaone4Config

        return Exaone4Config(
            **common,
            head_dim=head_dim,
            sliding_window=spec.sliding_window or 4096,
            layer_types=exaone_layers,
        )
    if spec.arch == "exaone_moe":
        from transformers import ExaoneMoeConfig

        k = spec.first_k_dense_replace  # the first k layers dense
        return ExaoneMoeConfig(
            **common,
            head_dim=head_dim,
            sliding_window=spec.sliding_window or 4096,
            layer_types=exaone_layers,
            mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_layers - k),
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_shared_experts=spec.n_shared_experts,
            n_group=spec.n_group,
            topk_group=spec.topk_group,
            routed_scaling_factor=spec.routed_scaling_factor,
            norm_topk_prob=True,
        )
    if spec.arch == "gemma4_text":
        from transformers import Gemma4TextConfig

        common.pop("hidden_act")
        full_rope = {
            "rope_type": "proportional",
            "partial_rotary_factor": spec.partial_rotary_factor,
            "rope_theta": spec.rope_theta,
        }
        return Gemma4TextConfig(
            **dict(
                common,
                rope_parameters={
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": spec.rope_local_theta,
                    },
                    "full_attention": full_rope,
                },
            ),
            head_dim=head_dim,
            global_head_dim=spec.global_head_dim,
            num_global_key_value_heads=spec.num_global_kv_heads,
            attention_k_eq_v=spec.attention_k_eq_v,
            num_kv_shared_layers=spec.num_kv_shared_layers,
            use_double_wide_mlp=spec.use_double_wide_mlp,
            hidden_size_per_layer_input=spec.hidden_size_per_layer_input,
            vocab_size_per_layer_input=vocab_size,
            enable_moe_block=spec.enable_moe_block,
            **(
                dict(
                    num_experts=spec.num_experts,
                    top_k_experts=spec.num_experts_per_tok,
                    moe_intermediate_size=spec.moe_intermediate_size,
                )
                if spec.enable_moe_block
                else {}
            ),
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=spec.sliding_window or 4096,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(spec.num_layers)
            ],
            final_logit_softcapping=spec.final_logit_softcapping,
            attention_bias=False,
        )
    if spec.arch == "gemma2":
        from transformers import Gemma2Config

        common.pop("hidden_act")
        return Gemma2Config(
            **common,
            head_dim=head_dim,
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=spec.sliding_window or 4096,
            query_pre_attn_scalar=spec.query_pre_attn_scalar or head_dim,
            attn_logit_softcapping=spec.attn_logit_softcapping,
            final_logit_softcapping=spec.final_logit_softcapping,
            attention_bias=False,
        )
    if spec.arch == "nemotron":
        from transformers import NemotronConfig

        common.pop("rms_norm_eps")
        common["rope_parameters"]["partial_rotary_factor"] = spec.partial_rotary_factor
        return NemotronConfig(
            **dict(common, hidden_act="relu2"),
            norm_eps=spec.rms_norm_eps,
            attention_bias=False,
            mlp_bias=False,
        )
    if spec.arch == "gpt_oss":
        from transformers import GptOssConfig

        common.pop("hidden_act")
        common["intermediate_size"] = spec.moe_intermediate_size  # the expert width
        common["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": spec.rope_theta,
            "factor": spec.yarn_factor,
            "original_max_position_embeddings": spec.yarn_original_max_position_embeddings,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
        return GptOssConfig(
            **common,
            head_dim=head_dim,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            sliding_window=spec.sliding_window or 128,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(spec.num_layers)
            ],
            attention_bias=True,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
        )
    if spec.arch == "nemotron_h":
        from transformers import NemotronHConfig

        for key in ("rms_norm_eps", "rope_parameters", "hidden_act", "num_hidden_layers"):
            common.pop(key)
        # transformers' Nemotron-H ties no weights (lm_head stays apart whatever the config
        # says): untied always, as the engine requires
        common["tie_word_embeddings"] = False
        return NemotronHConfig(
            **common,
            hybrid_override_pattern=spec.hybrid_pattern,
            head_dim=head_dim,
            layer_norm_epsilon=1e-5,  # megatron's gated Mamba norm fixes it (not rms_norm_eps)
            mlp_hidden_act="relu2",
            mamba_num_heads=spec.mamba_num_heads,
            mamba_head_dim=spec.mamba_head_dim,
            n_groups=spec.mamba_n_groups,
            ssm_state_size=spec.ssm_state_size,
            chunk_size=spec.mamba_chunk_size,
            time_step_min=spec.time_step_min,
            use_mamba_kernels=False,
        )
    if spec.arch == "falcon_h1":
        from transformers import FalconH1Config

        for key in ("rms_norm_eps", "rope_parameters"):
            common.pop(key)
        return FalconH1Config(
            **common,
            head_dim=head_dim,
            rms_norm_eps=1e-5,  # megatron's gated Mamba norm fixes it (with mamba_rms_norm)
            rope_theta=spec.rope_theta,
            mamba_d_ssm=spec.mamba_num_heads * spec.mamba_head_dim,
            mamba_n_heads=spec.mamba_num_heads,
            mamba_d_head=spec.mamba_head_dim,
            mamba_n_groups=spec.mamba_n_groups,
            mamba_d_state=spec.ssm_state_size,
            mamba_chunk_size=spec.mamba_chunk_size,
            **dict(dict(mamba_rms_norm=False), **spec.falcon_h1_config),
        )
    raise ValueError(f"arch={spec.arch!r}: must be one of {ARCHS}")


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, **overrides) -> Path:
    """Write a tiny HF model directory (config.json, safetensors, tokenizer files; for
    :data:`VL_ARCHS` also the image processor's ``preprocessor_config.json``) to ``out_dir``.

    ``overrides`` set fields of :class:`TinyModelSpec`. Deterministic for a given spec.
    """
    import torch
    from transformers import AutoModelForCausalLM

    spec = spec or TinyModelSpec()
    for k, v in overrides.items():
        if not hasattr(spec, k):
            raise ValueError(
                f"{k}: unknown tiny-model field; allowed: "
                f"{sorted(TinyModelSpec.__dataclass_fields__)}"
            )
        setattr(spec, k, v)
    if spec.arch not in ARCHS + VL_ARCHS:
        raise ValueError(f"arch={spec.arch!r}: must be one of {ARCHS + VL_ARCHS}")
    if (
        spec.head_dim is None and spec.hidden_size % spec.num_heads
    ) or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            "hidden_size must divide by num_heads (unless head_dim is given) and "
            "num_heads by num_kv_heads"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(spec.charset)
    if spec.arch in VL_ARCHS:
        return make_tiny_vl(out, spec, tok)
    cfg = _hf_config(spec, len(tok), tok.pad_token_id, tok.eos_token_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # a non-zero expert bias, so that tests see it applied
        # (a buffer in most families, a frozen parameter in Ernie 4.5's moe_statics)
        for name, buf in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, spec.expert_bias_std)
    if spec.arch in ("gemma3_text", "gemma", "gemma2", "nemotron"):
        # (1 + w) norms (transformers starts Gemma's at zero, Nemotron's at one): random ones
        # make every norm count; Nemotron's LayerNorm biases too
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "norm.bias")):
                    p.normal_(0.0, 0.2)
    if spec.arch == "gemma4_text":
        # norms, router scales and layer_scalar start at one: random ones make each count
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("norm.weight", "router.scale", "router.per_expert_scale")):
                    t.normal_(1.0, 0.3)
                elif name.endswith("layer_scalar"):
                    t.uniform_(0.5, 1.5)
    if spec.arch in ("ernie4_5_moe", "exaone_moe", "exaone4"):
        # RMSNorms start at one: random gains make every channel of every norm count (EXAONE:
        # input / post-attention / post-feedforward, QK, final; a norm mapped to another's place
        # shows); Ernie's router gate starts at zero in transformers (every expert tied): a
        # random one
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.3)
                elif spec.arch == "ernie4_5_moe" and name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, spec.initializer_range)
    if spec.arch in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        # (1 + w) norms start at zero and the gated delta-net's output norm (gain w) at one,
        # its dt_bias at one: random ones make each count; the output norm's gains in
        # [0.5, 1.5], where megatron's w - 1 and back is exact
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("linear_attn.norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith("norm.weight"):
                    p.normal_(0.0, 0.2)
                elif name.endswith("linear_attn.dt_bias"):
                    p.normal_(1.0, 0.5)
    if spec.arch in ("nemotron_h", "falcon_h1"):
        # every norm (layer, gated Mamba, final) with random gains around one; A_log in
        # [-1, 1] so that the states decay at visibly different rates per head; the other
        # weights (transformers' init leaves out_proj and the convolution small) large enough
        # that the Mamba branch (Nemotron-H's ``mixer``, Falcon-H1's ``mamba``) moves the
        # residual stream
        mixer = ".mixer." if spec.arch == "nemotron_h" else ".mamba."
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "norm_f.weight")):
                    p.normal_(1.0, 0.3)
                elif name.endswith("A_log"):
                    p.uniform_(-1.0, 1.0)
                elif mixer in name and name.endswith(("in_proj.weight", "out_proj.weight")):
                    p.normal_(0.0, 0.15)
                elif name.endswith(("conv1d.weight", "conv1d.bias", ".D", "dt_bias")):
                    p.normal_(0.0, 0.3)
    if spec.arch in ("olmoe", "minimax_m2"):
        # the whole-projection QK norms start at one: random gains make every channel count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.3)
    if spec.arch == "gpt_oss":
        # sinks, router biases and expert weights large enough that the sinks take weight,
        # the router bias changes choices and the GLU clamp at 7 bites (transformers' init
        # draws them with initializer_range, where none of that happens)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("self_attn.sinks"):
                    p.normal_(0.0, 1.0)
                elif name.endswith("mlp.router.bias"):
                    p.normal_(0.0, 0.5)
                elif name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
                    p.normal_(0.0, 1.0)
                elif name.endswith(("experts.down_proj", "experts.down_proj_bias")):
                    p.normal_(0.0, 0.1)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "tiny_model_spec.json").write_text(json.dumps(spec.__dict__, indent=2))
    return out

"""transformers' config of each tiny family of :mod:`areal_mega.models.tiny` (its sizes from
:class:`~areal_mega.models.tiny.TinyModelSpec`, each family's own keys set so that the tiny
model exercises what the family changes)."""

from __future__ import annotations

__all__ = ["text_keys", "tiny_hf_config"]


def text_keys(spec, vocab_size: int, pad_id: int, eos_id: int) -> dict:
    """The language model's config keys every tiny family shares, text-only or the text config
    of a vision-language one: its sizes, norm epsilon, special token ids, initialiser range,
    plain RoPE, SiLU and no attention dropout (a family sets its own over these)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        initializer_range=spec.initializer_range,
        rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"},
        hidden_act="silu",
        attention_dropout=0.0,
    )


def tiny_hf_config(spec, vocab_size: int, pad_id: int, eos_id: int):
    """transformers' config of the tiny model ``spec`` (a
    :class:`~areal_mega.models.tiny.TinyModelSpec`) describes (``ValueError`` for an unknown
    family)."""
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
        text_keys(spec, vocab_size, pad_id, eos_id), tie_word_embeddings=spec.tie_word_embeddings
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
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, GLM-MoE-DSA)
    mla = dict(
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
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
    if spec.arch in ("glm4_moe_lite", "glm_moe_dsa"):
        common["num_key_value_heads"] = spec.num_heads
        routing.pop("first_k_dense_replace")
        k = spec.first_k_dense_replace
        layers = dict(
            mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_layers - k),
            attention_bias=False,
        )
        if spec.arch == "glm4_moe_lite":
            from transformers import Glm4MoeLiteConfig

            return Glm4MoeLiteConfig(**common, **routing, **mla, **layers, rope_interleave=True)
        from transformers import GlmMoeDsaConfig

        return GlmMoeDsaConfig(
            **common,
            **routing,
            **mla,
            **layers,
            index_topk=spec.index_topk,
            index_head_dim=spec.index_head_dim,
            index_n_heads=spec.index_n_heads,
            # transformers makes indexer_types of these (offset default 2); 1: all 'full'
            index_topk_freq=spec.index_topk_freq,
            index_skip_topk_offset=spec.index_skip_topk_offset,
            num_experts=spec.num_experts,  # a second expert count the config keeps (unread)
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
            **mla,
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
            **mla,
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
    raise ValueError(f"arch={spec.arch!r}: no tiny config for this family")

"""The families checked end to end by tests/test_new_families.py (and its 2-rank worker
tests/helpers/family_worker.py). Adding a family: one :class:`FamilyCase` in :data:`CASES`.

Every case is a tiny HF model made locally (:func:`areal_mega.models.tiny.make_tiny_model`
with ``tiny``), on the digits vocabulary so that the same model also runs the RL steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mega.models.tiny import TinyModelSpec


@dataclass(frozen=True)
class FamilyCase:
    """One family under test.

    ``tiny``: :func:`make_tiny_model` overrides (``arch`` is the model type); ``layouts``:
    the 2-rank layouts compared with the single-rank reference (``tp2``, ``pp2``, ``ep2``
    for MoE: EP2 inside DP2; ``tp2sp``: TP2 with sequence parallelism, which MoE needs;
    ``pp2_recompute``: PP2 with full activation recompute; ``tp2sp_recompute``: TP2 with
    sequence parallelism and full activation recompute; ``pp2_vpp2``: PP2 with two virtual
    stages each, the interleaved schedule; ``pp2_vpp2_recompute``: that with full activation
    recompute; ``tp2sp_etp1``: ``tp2sp`` with the routed experts whole on each rank, expert
    TP 1);
    ``convert``: the layout ``tools/convert_hf_to_mcore.py`` writes
    (``--tp 2 --pp 2`` style flags); ``rl_overrides``: extra ``launch.local`` overrides of
    its RL run; ``rl_tiny``: :func:`make_tiny_model` overrides of its RL run's model;
    ``config_variants``: name -> ``config.json`` overrides under which the same converted
    weights are also checked against transformers (on DP2); ``shared_prompts``: also
    PP2 and TP2 on GRPO-like groups whose prompts the engine computes once (rotary at given
    positions, the shared-prefix attention) against the single-rank reference (dense families
    only: the engine shares no prompts for MoE). The checked sequences (up to 21 tokens), the
    shared prompts (up to 17) and the RL samples are longer than a sliding window of 8."""

    name: str
    tiny: dict
    layouts: tuple = ("tp2", "pp2")
    convert: tuple = ("--tp", "2", "--pp", "2")
    rl_overrides: tuple = field(default_factory=tuple)
    rl_tiny: dict = field(default_factory=dict)
    config_variants: dict = field(default_factory=dict)
    shared_prompts: bool = False


#: the Falcon-H1 cases' tiny model (both, the gated norm aside): the Mamba sizes of
#: nemotron_h's case, untied
FALCON_H1_TINY = dict(
    arch="falcon_h1",
    hidden_size=32,
    intermediate_size=48,
    mamba_chunk_size=32,
    tie_word_embeddings=False,
)

CASES = {
    # explicit head_dim (24, not hidden/heads = 16) and a window (8) shorter than the
    # sequences; also with sliding_window: null (many Mistral checkpoints)
    "mistral": FamilyCase(
        "mistral",
        dict(arch="mistral", head_dim=24, sliding_window=8, tie_word_embeddings=False),
        config_variants={"nowindow": {"sliding_window": None}},
    ),
    # Gemma 3: layers sliding (window 8, RoPE base 1e4) then full (RoPE base 1e6), softmax scale
    # 32^-0.5 (not head_dim^-0.5), random (1 + w) norms, tied embeddings; also with linear RoPE
    # scaling of the full layers
    "gemma3_text": FamilyCase(
        "gemma3_text",
        dict(
            arch="gemma3_text",
            head_dim=24,
            sliding_window=8,
            rope_theta=1e6,
            query_pre_attn_scalar=32,
        ),
        config_variants={
            "linear_rope": {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                }
            }
        },
    ),
    # Gemma (1): (1 + w) norms in fp32, GELU-tanh GLU, embeddings scaled by sqrt(hidden), tied;
    # head_dim 24 (not hidden/heads = 16)
    "gemma": FamilyCase("gemma", dict(arch="gemma", head_dim=24)),
    # DeepSeek-V2: multi-latent attention (q low-rank pair), softmax top-2 of 4 experts without
    # renormalisation times routed_scaling_factor 2.5, a shared expert, layer 0 dense
    "deepseek_v2": FamilyCase(
        "deepseek_v2",
        dict(arch="deepseek_v2", tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # GLM-4-MoE-Lite (GLM-4.7-Flash): DeepSeek-V3's attention and sigmoid router with expert
    # bias, group-limited top-2, shared expert; dense layers from mlp_layer_types (layer 0)
    "glm4_moe_lite": FamilyCase(
        "glm4_moe_lite",
        dict(arch="glm4_moe_lite", tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # GLM-MoE-DSA (GLM-5): GLM-4-MoE-Lite's layers with DeepSeek sparse attention, each
    # query attending to the 6 earlier tokens its indexer (8 heads of 16) scores best. The RL
    # run attends to every earlier token (index_topk 64, longer than its samples): a top-k is
    # discontinuous, and at a near-tie the rollout server's cached decode and a full forward
    # can choose differently (transformers' own cached decode departs from its own full
    # forward on about 1 sample in 80 of this tiny model, by 2e-5 to 1e-2 nats); the sparse
    # choice is checked against transformers' full forward by the layouts above. Four layers,
    # indexer_types full, shared, full, shared (index_topk_freq 2 from layer 0): the shared
    # ones have no indexer and reuse the layer before's top-k; each PP2 stage starts on a full one
    "glm_moe_dsa": FamilyCase(
        "glm_moe_dsa",
        dict(
            arch="glm_moe_dsa",
            tie_word_embeddings=False,
            num_layers=4,
            index_topk_freq=2,
            index_skip_topk_offset=1,
        ),
        rl_tiny=dict(index_topk=64),
        layouts=("ep2", "pp2", "pp2_recompute", "tp2sp"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # HY-V3 (Hy3): GQA with per-head QK norm (head_dim 16), sigmoid top-2 of 4 experts with
    # expert bias, renormalised, times router_scaling_factor 2.5, a shared expert; layer 0
    # dense by mlp_layer_types; checkpoint names of the hub (mlp.router.gate, mlp.expert_bias,
    # mlp.shared_mlp), which the rollout server renames as transformers does
    "hy_v3": FamilyCase(
        "hy_v3",
        dict(arch="hy_v3", tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # Nemotron: LayerNorm with a (1 + w) gain and a bias (random, so every norm counts),
    # squared-ReLU MLP without a gate, rotary on half of each head's channels, untied
    "nemotron": FamilyCase("nemotron", dict(arch="nemotron", tie_word_embeddings=False)),
    # Nemotron-H: megatron-core's HybridModel, layers Mamba-2, attention, Mamba-2, MLP (squared
    # ReLU, no gate), untied (transformers ties no weights); the Mamba scan's chunk (32) above
    # the checked sequences' lengths, since transformers' torch path is wrong past its first
    # chunk (megatron's scan across chunks is checked against transformers in
    # tests/test_nemotron_h.py, one chunk per sequence there); every norm with random gains,
    # A_log in [-1, 1], the mixers' projections, convolution, D and dt bias drawn large enough
    # that the Mamba branches move the logits (make_tiny_model; on 21 tokens, largest logit
    # 0.45: zeroing the mixers' out_proj moves the logits by 0.55, their D by 0.62, unit gains
    # on their gated norms by 0.16); transformers' dt clamp at time_step_min does not bite
    # (time_step_min 1e-9, the smallest dt there 0.057; see TinyModelSpec)
    "nemotron_h": FamilyCase(
        "nemotron_h",
        dict(
            arch="nemotron_h",
            hidden_size=32,
            intermediate_size=48,
            mamba_chunk_size=32,
            tie_word_embeddings=False,
        ),
    ),
    # Falcon-H1: a Mamba-2 mixer beside the attention in every layer, then the gated MLP, with
    # every muP multiplier away from one (embedding, lm_head, key, attention in / out, SSM in /
    # out, the five sections of the Mamba input projection, the MLP's gate / down; TinyModelSpec)
    # and the Mamba sizes and weights of nemotron_h's case (one scan chunk per checked
    # sequence); TP2 splits the Mamba heads and groups; untied
    "falcon_h1": FamilyCase("falcon_h1", FALCON_H1_TINY),
    # Falcon-H1 with the gated Mamba norm (mamba_rms_norm, gating before normalising as
    # megatron's mixer does; the other order is refused), its gains random around one (unit
    # gains would move the logits by 0.16, nemotron_h's case); the falcon_h1 case's sizes and
    # multipliers; no RL run of its own (falcon_h1's covers the server's Mamba cache; the
    # server runs transformers' model, gated norm included)
    "falcon_h1_gated": FamilyCase(
        "falcon_h1_gated",
        dict(
            FALCON_H1_TINY,
            falcon_h1_config=dict(
                TinyModelSpec().falcon_h1_config,
                mamba_rms_norm=True,
                mamba_norm_before_gate=False,
            ),
        ),
    ),
    # Gemma 2: Gemma 3's layer without QK norms (sliding window 8 on even layers, one RoPE
    # base), attention scores capped at 1.0 and final logits at 2.0 by tanh, softmax scale
    # 32^-0.5; weights drawn with std 0.1, so that both caps bite (at 0.02 the attention
    # cap moved the logits by 8e-6, under the tolerance; at 0.1 by 0.33); also with no caps
    "gemma2": FamilyCase(
        "gemma2",
        dict(
            arch="gemma2",
            head_dim=24,
            sliding_window=8,
            query_pre_attn_scalar=32,
            initializer_range=0.1,
        ),
        config_variants={
            "no_softcap": {"attn_logit_softcapping": None, "final_logit_softcapping": None}
        },
    ),
    # OLMoE: softmax top-2 of 4 experts without renormalisation, every layer MoE, no shared
    # expert; one RMSNorm over the whole query (and key) projection, random gains, which TP2
    # splits across ranks (the statistic all-reduced)
    "olmoe": FamilyCase(
        "olmoe",
        dict(arch="olmoe", tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # MiniMax-M2: OLMoE's whole-projection QK norms (head_dim 24, not hidden/heads = 16),
    # rotary on half of each head, a sigmoid top-2 of 4 router with the expert bias for the
    # choice, renormalised; checkpoint names of the hub (block_sparse_moe, w1 / w3 / w2),
    # which the rollout server renames as transformers does
    "minimax_m2": FamilyCase(
        "minimax_m2",
        dict(arch="minimax_m2", head_dim=24, tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # GPT-OSS: attention sinks, biases on every projection, sliding (window 8) and full
    # layers, YaRN (factor 4 over 16 positions), a softmax over the top-2 of 4 router logits
    # with a router bias, biased experts (width 48, not square: the down projection's
    # orientation counts) with the GLU clamp at 7; drawn so that each bites (transformers'
    # logits move by: sinks off 0.46, router bias off 0.68, no clamp 0.37, plain RoPE 8.8e-3);
    # each layer's experts in one checkpoint tensor, gate and up interleaved. TP with the
    # experts at expert-TP 1 only: megatron-core takes biased experts at expert-TP 1 only
    # (expert-TP 2 refused, test_model_support)
    "gpt_oss": FamilyCase(
        "gpt_oss",
        dict(
            arch="gpt_oss",
            head_dim=16,
            sliding_window=8,
            moe_intermediate_size=48,
            tie_word_embeddings=False,
        ),
        layouts=("ep2", "pp2", "tp2sp_etp1"),
        convert=("--ep", "2", "--pp", "2", "--tp", "2", "--etp", "1"),
        # the RL run's trainer: TP 2 with sequence parallelism, the experts whole on each rank
        # (also the suite's text-model trainer of two ranks converting model.path itself)
        rl_overrides=(
            "allocation=local:d1+megatron:(attn:t2|ffn:t1)",
            "actor.sequence_parallel=true",
        ),
    ),
    # Ernie 4.5 MoE: top-2 of 4 experts chosen by softmax score + expert bias, the chosen
    # (unbiased) scores renormalised; a shared expert; four layers, MoE where (i + 1) % 2 == 0
    # (layers 1 and 3; the provider alone would make layers 1-3 MoE); interleaved rotary with
    # the config's base (10000; the provider fixes 500000); random RMSNorm gains and router
    # gate (transformers starts it at zero: every expert tied). The expert bias (std 0.05)
    # changes the chosen pair of 13 / 60 tokens in layer 1 and 46 / 60 in layer 3 of the
    # checked sequences against the unbiased top-2 (counted with hooks on transformers' gates).
    # Tied embeddings, as the hub's models; hub checkpoint names
    # (mlp.moe_statics.e_score_correction_bias [1, 4], per-expert gate / up / down), which the
    # rollout server renames as transformers does
    "ernie4_5_moe": FamilyCase(
        "ernie4_5_moe",
        dict(
            arch="ernie4_5_moe",
            num_layers=4,
            moe_layer_interval=2,
            expert_bias_std=0.05,
        ),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # EXAONE-MoE (K-EXAONE): layer 0 sliding window 8 with rotary and a dense MLP, layer 1 full
    # attention without rotary (NoPE) and MoE; per-head QK norms; DeepSeek-V3's sigmoid
    # router with the expert bias for the choice, 2 groups of which 1 is kept, top-2 of 4,
    # renormalised times 2.5, one shared expert
    "exaone_moe": FamilyCase(
        "exaone_moe",
        dict(arch="exaone_moe", sliding_window=8, tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # EXAONE 4: post-norm-only layers (no norm before attention or the MLP; random gains on
    # the post-attention / post-feedforward, QK and final norms), layer 0 sliding window 8
    # with rotary, layer 1 full attention without rotary (NoPE), untied embeddings as
    # EXAONE-4.0-32B (the bridge's registry maps no lm_head: Llama's row); also with
    # llama3 RoPE (EXAONE 4.0's configs) and without a window (EXAONE-4.0-1.2B: every layer
    # full attention, rotary on all); shared prompts: the NoPE layer and the window on the
    # engine's shared-prefix path
    "exaone4": FamilyCase(
        "exaone4",
        dict(arch="exaone4", sliding_window=8, tie_word_embeddings=False),
        config_variants={
            "llama3_rope": {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 16.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            "nowindow": {"sliding_window": None, "layer_types": ["full_attention"] * 2},
        },
        shared_prompts=True,
    ),
    # Qwen3-Next: a gated delta-net layer (2 key / 4 value heads, widths 8 / 12, convolution
    # of 4) then a full-attention layer with the output gate, QK norms and partial rotary
    # (rope_parameters' 0.5; the config's top-level 0.25 is what the provider reads); softmax
    # top-2 of 4 experts renormalised, a shared expert behind a sigmoid gate; random (1 + w)
    # norms, output-norm gains and dt_bias (transformers starts them at zero / one)
    "qwen3_next": FamilyCase(
        "qwen3_next",
        dict(arch="qwen3_next", head_dim=16, tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # Qwen3.5 (dense text model): Qwen3-Next's layers with the delta-net's input projection
    # in four checkpoint tensors and dense MLPs; TP2 without sequence parallelism (the
    # delta-net's output-norm gradient summed over the ranks' heads in the graph)
    "qwen3_5_text": FamilyCase(
        "qwen3_5_text", dict(arch="qwen3_5_text", head_dim=16, tie_word_embeddings=False)
    ),
    # Qwen3.5-MoE (text model): Qwen3.5's layers with Qwen3-Next's MoE (softmax top-2 of 4
    # renormalised, a shared expert behind a sigmoid gate)
    "qwen3_5_moe_text": FamilyCase(
        "qwen3_5_moe_text",
        dict(arch="qwen3_5_moe_text", head_dim=16, tie_word_embeddings=False),
        layouts=("ep2", "tp2sp", "pp2"),
        convert=("--tp", "2", "--ep", "2"),
    ),
    # Gemma 4 (dense text model): layers sliding (window 8, head_dim 16, 2 KV heads, RoPE base
    # 1e4) / full (global_head_dim 32, K = V with 2 global KV heads, no v_proj, proportional
    # RoPE on a quarter of the channels, base 1e4 here); layers 2 and 3 share the keys /
    # values of layers 0 and 1 (no k / v projections, double-wide MLPs); per-layer inputs of
    # width 8; random norm gains and layer scalars; final logits capped at 2.0; norm epsilon
    # 1e-2 (the values' scale-less norm takes it too). PP2: the second stage's shared layers
    # read the first stage's keys / values and per-layer inputs, sent with the hidden state
    # (PP2 x VPP2: a layer a chunk, each boundary sends its own set; PP2 with full recompute:
    # 1F1B runs a micro-batch's forward before an earlier one's recomputing backward, as the
    # interleaved schedule does chunk by chunk);
    # TP2 with and without SP, and with SP under full activation recompute (one layer per
    # checkpoint: the shared layers' and the per-layer inputs' gradients relayed across
    # checkpoints); its RL run recomputes too
    "gemma4_text": FamilyCase(
        "gemma4_text",
        dict(
            arch="gemma4_text",
            num_layers=4,
            num_kv_shared_layers=2,
            head_dim=16,
            sliding_window=8,
            rms_norm_eps=1e-2,
        ),
        layouts=(
            "tp2",
            "tp2sp",
            "tp2sp_recompute",
            "pp2",
            "pp2_vpp2",
            "pp2_recompute",
            "pp2_vpp2_recompute",
        ),
        convert=("--tp", "2", "--pp", "2"),
        rl_overrides=("model.recompute_granularity=full",),
    ),
    # Gemma 4 without key/value sharing and without per-layer inputs (the 31B layout);
    # full layers with v_proj (attention_k_eq_v off) and the sliding layers' 2 KV heads,
    # although the config says num_global_key_value_heads 1 (transformers reads it only with
    # K = V; the bridge's provider would give the full layers 1)
    "gemma4_text_plain": FamilyCase(
        "gemma4_text_plain",
        dict(
            arch="gemma4_text",
            head_dim=16,
            sliding_window=8,
            attention_k_eq_v=False,
            num_global_kv_heads=1,
            hidden_size_per_layer_input=0,
        ),
    ),
    # Gemma 4 with the MoE block (26B-A4B's layout): every layer's dense MLP beside 4 routed
    # experts (top 2), each branch with its own random norms, a random router scale and
    # per-expert scales; no key/value sharing or per-layer inputs, so PP with full activation
    # recompute runs (refused with either); full layers K = V with 2 global KV heads
    "gemma4_text_moe": FamilyCase(
        "gemma4_text_moe",
        dict(
            arch="gemma4_text",
            head_dim=16,
            sliding_window=8,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
        ),
        layouts=("ep2", "tp2sp", "pp2", "pp2_recompute"),
        convert=("--tp", "2", "--ep", "2"),
    ),
}

# A MoE family adds EP2 (checked with qwen3_moe, 3 tests in ~50 s on 2 cores):
#   FamilyCase("qwen3_moe", dict(arch="qwen3_moe", tie_word_embeddings=False),
#              layouts=("ep2", "tp2"), convert=("--tp", "2", "--ep", "2"))

#: the full end-to-end set (RL steps through launch.local) runs for these
RL_CASES = (
    "mistral",
    "gemma3_text",
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
    "gemma4_text_moe",
    "falcon_h1",
    "glm_moe_dsa",
)


def tiny_spec(case: FamilyCase) -> dict:
    """:func:`make_tiny_model` keyword arguments of ``case``."""
    return dict(
        dict(
            charset="digits",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
        ),
        **case.tiny,
    )

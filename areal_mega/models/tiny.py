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

from areal_mega.models.tiny_configs import tiny_hf_config
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
    "glm_moe_dsa",
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
    # glm_moe_dsa: the sparse attention's indexer (its heads, head size, and how many earlier
    # tokens each query attends to: fewer than the tests' sequences, so the choice matters;
    # 8 heads, so that the ReLU'd scores rarely tie at zero)
    index_topk: int = 6
    index_head_dim: int = 16
    index_n_heads: int = 8
    # and its top-k sharing (transformers' index_topk_freq / index_skip_topk_offset: layer i
    # runs the indexer when max(i - offset + 1, 0) % freq == 0, the others reuse the last
    # top-k; freq 1: every layer runs its own)
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
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
    cfg = tiny_hf_config(spec, len(tok), tok.pad_token_id, tok.eos_token_id)
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
    if spec.arch == "glm_moe_dsa":
        # transformers zeroes the <pad> row of the embedding (padding_idx): a sampled <pad>
        # would give its indexer query zero, every key's score 0, and the top-k would be
        # decided by tie-breaking, which differs between a full forward and a cached decode
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb[0].normal_(0.0, spec.initializer_range)
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

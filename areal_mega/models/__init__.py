"""megatron-core models built from Hugging Face configs, and their attention.

- :mod:`.builder` — a ``GPTModel`` from a ``config.json`` (Llama, Qwen2/3, Qwen3-MoE, Mistral,
  Gemma, Gemma 2, Gemma 3 text, GLM-4 MoE, GLM-4-MoE-Lite, DeepSeek-V2/V3, HY-V3, Nemotron,
  OLMoE, MiniMax-M2, GPT-OSS, Ernie 4.5 MoE, EXAONE-MoE, EXAONE 4, Qwen3-Next,
  Qwen3.5, Qwen3.5-MoE, Gemma 4 text, Falcon-H1, GLM-MoE-DSA);
- :mod:`.decoder_fields` — the decoder facts every HF config states the same way (sizes,
  heads, RoPE base, norm epsilon), with each family's defaults;
- :mod:`.bridge_provider` — the architecture fields of the megatron config from
  Megatron-Bridge's model providers (and the defects we correct, the families not built);
- :mod:`.backend` — which attention implementation and GPU fusions a model is built with
  (pure decisions on probed facts);
- :mod:`.gemma3` — what Gemma 3 (and Gemma 1) change against the Llama math, on megatron's
  local spec;
- :mod:`.gemma2` — Gemma 2: Gemma 3's layer with attention and final-logit soft-caps;
- :mod:`.gemma4` — Gemma 4 text (dense and MoE): per-layer-type attention shapes, K = V,
  key/value sharing, per-layer inputs, layer scalars and the MoE block on megatron's local spec;
- :mod:`.gemma4_forward_state` — what one Gemma 4 forward shares between a chunk's layers (the
  keys / values, the per-layer inputs) and, under full recompute, its gradient relay;
- :mod:`.gemma4_pipeline` — what Gemma 4's pipeline stages pass besides the hidden state (the
  keys / values shared layers read, the per-layer inputs), on its last dimension;
- :mod:`.gradient_relay` — a tensor a later layer reads outside its inputs (Gemma 4's shared
  keys / values, per-layer inputs), its gradient carried back to its maker across full
  activation recompute's checkpoints;
- :mod:`.mla` — DeepSeek-V2/V3's (and GLM-4-MoE-Lite's) multi-latent attention on megatron-core's
  ``MLASelfAttention``;
- :mod:`.family_router` — megatron's ``TopKRouter`` with a family's own routing (Ernie 4.5,
  Gemma 4 MoE);
- :mod:`.dsa` — GLM-MoE-DSA (GLM-5): DeepSeek sparse attention on megatron-core's absorbed MLA
  and ``DSAttention`` with a local backend;
- :mod:`.nemotron` — Nemotron's LayerNorm with a ``(1 + w)`` gain on megatron's local spec;
- :mod:`.nemotron_h` — Nemotron-H: megatron's HybridModel (Mamba-2, attention and MLP
  layers) from the bridge's provider on the local hybrid spec;
- :mod:`.falcon_h1` — Falcon-H1: its config fields from the bridge's provider, muP
  multipliers, refusals, and why the engine builds its own layers (a Mamba-2 mixer beside the
  attention) rather than the bridge's FalconH1Model;
- :mod:`.falcon_h1_layers` — Falcon-H1's megatron-core modules: the layer spec, the parallel
  Mamba / attention mixer, the muP-scaled Mamba input projection and MLP;
- :mod:`.olmoe` — OLMoE's (and MiniMax-M2's) RMSNorm over the whole query / key projection,
  tensor-parallel;
- :mod:`.gpt_oss` — GPT-OSS: its config fields (sinks, windows, YaRN, biased experts with the
  clamped GLU) and the provider's corrections;
- :mod:`.expert_bias` — routed experts' biases left out of megatron's sequence-parallel
  gradient sum over TP (a megatron-core defect that counts them twice with expert TP 1);
- :mod:`.ernie4_5_moe` — Ernie 4.5 MoE's router (softmax scores, an expert bias for the choice,
  the chosen weights renormalised) as a megatron ``TopKRouter``;
- :mod:`.moe_families` — config fields and options of the DeepSeek-style MoE families (and
  HY-V3, MiniMax-M2);
- :mod:`.exaone` — EXAONE-MoE and EXAONE 4: per-layer window and rotary (NoPE full-attention
  layers), EXAONE 4's post-norm-only layer, refusals;
- :mod:`.qwen3_next` — Qwen3-Next: gated delta-net layers beside gated full attention on
  megatron's local spec, its config fields and refusals;
- :mod:`.sliding_window` — sliding-window attention (Mistral): the key, megatron's window, the
  masks;
- :mod:`.varlen_attention` — packed attention for megatron's local spec, no work across
  sequences;
- :mod:`.rope_positions` — rotary embeddings at given positions (shared prompt prefixes);
- :mod:`.tiny` — tiny random-weight HF models and a character tokenizer, no network;
- :mod:`.tiny_configs` — transformers' config of each tiny family;
- :mod:`.vlm` — vision-language models (Qwen2.5-VL) built from the bridge's provider: its
  vision tower, projector and multimodal RoPE, our runtime fields and packed attention.
"""

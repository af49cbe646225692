"""Vision-language models built by the engine from Megatron-Bridge's providers.

The whole model is the bridge's: its provider (``Qwen25VLModelProvider``) builds
``Qwen25VLModel``, i.e. transformers' vision tower and projector, megatron-core's language
model with multimodal RoPE, and the forward that scatters the image features into the token
embeddings and computes each sample's 3-D positions (also for packed THD micro-batches). Ours
are the runtime fields (our mesh, dtype, CPU fusions: :func:`areal_mega.models.builder.
runtime_config_fields`), the language model's layer spec (the local spec with our packed
attention, :mod:`areal_mega.models.varlen_attention`) and the provider corrections
(:data:`areal_mega.models.bridge_provider.CORRECTIONS`).

* :mod:`.config`: which configs are built, and the keys refused;
* :mod:`.builder`: the model chunks of one rank;
* :mod:`.inputs`: images and text to model inputs, packed micro-batches;
* :mod:`.tiny`: a tiny random-weight model with its image processor and tokenizer.

An HF checkpoint's tensors go into the built model (and back) through the bridge's table in
:mod:`areal_mega.checkpoint.vl_mapping`.
"""

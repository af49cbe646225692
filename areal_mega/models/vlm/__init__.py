"""Vision-language models built by the engine from Megatron-Bridge's providers.

The whole model is the bridge's: its provider (Qwen2.5-VL's ``Qwen25VLModelProvider``) builds
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
* :mod:`.tiny`: a tiny random-weight model with its image processor and tokenizer;
* :mod:`.qwen3_vl`: Qwen3-VL (``qwen3_vl``): the bridge's ``Qwen3VLModel`` and vision tower,
  which its provider builds from TransformerEngine layers only, built on megatron-core's local
  layers (the tower on a bidirectional packed attention), with two corrections of the bridge's
  model (the mergers' exact GELU; the deepstack gradient summed over TP under sequence
  parallelism).

An HF checkpoint's tensors go into the built model (and back) through the bridge's table in
:mod:`areal_mega.checkpoint.vl_mapping`.
"""

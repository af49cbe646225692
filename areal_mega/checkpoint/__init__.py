"""Checkpoints and HF conversion.

* :mod:`.dist_ckpt` — ``save_checkpoint`` / ``load_checkpoint`` / ``find_latest`` /
  ``latest_verified`` / ``prune_checkpoints`` / ``verify_checkpoint`` (megatron
  ``dist_checkpointing``, atomic, reshardable over TP/PP/VPP/EP).
* :mod:`.checksums` — per-file CRC-32 recorded in ``areal_meta.json`` at save (torch-free).
* :mod:`.finite_weights` — non-finite weights refused on saving and on loading.
* :mod:`.verify` — completeness, sizes and checksums checked before a checkpoint is trusted, on
  one process or split over the ranks of a collective load.
* :mod:`.distopt_state` — the distributed optimizer's state in our own reshardable format.
* :mod:`.optimizer_switch` — a checkpoint's optimizer state loaded into the other kind of
  optimizer (regular <-> distributed: ``optimizer.use_distributed_optimizer`` switched).
* :mod:`.dcp_reader` — any region of a tensor read from a torch DCP checkpoint, chunk by chunk.
* :mod:`.hf_mapping` — the HF <-> megatron name/layout tables, one per family.
* :mod:`.hf_mapping_moe` — which rows of a family's table a config has (DeepSeek-style MoE
  families, optional parts of the others).
* :mod:`.hf_mapping_gdn` — Qwen3-Next's and Qwen3.5's tensors that are row permutations
  (gated QKV, the delta-net input projection) and its norm's offset.
* :mod:`.hf_mapping_gemma4` — Gemma 4's per-layer rows (QKV shapes per layer type, no k / v on
  key/value-shared layers, no v on K = V layers) and shapes for the live export.
* :mod:`.bridge_tables` — those tables read from Megatron-Bridge's mapping registries (kept in
  ``bridge_tables.json``).
* :mod:`.safetensors_io` — memory-bounded safetensors reading and writing, errors naming the
  file.
* :mod:`.value_model` — HF ``*ForSequenceClassification`` models as the critic's start.
* :mod:`.export` — live export of model chunks as HF-named tensors in buckets.
* :mod:`.convert` — offline HF <-> megatron converters (``tools/convert_*.py``).
* :mod:`.vl_mapping` — a vision-language model's tensors (Qwen2.5-VL) in and out through the
  bridge's table.
* :mod:`.vl_convert` — the converters for vision-language models (whole model, one rank).

Import the submodules; nothing heavy is imported here.
"""

"""Checkpoints and HF conversion.

* :mod:`.dist_ckpt` — ``save_checkpoint`` / ``load_checkpoint`` / ``find_latest`` /
  ``latest_verified`` / ``prune_checkpoints`` / ``verify_checkpoint`` (megatron
  ``dist_checkpointing``, atomic, reshardable over TP/PP/VPP/EP).
* :mod:`.checksums`, :mod:`.verify` — per-file CRC-32 written at save, checked before loading.
* :mod:`.hf_mapping` — the HF <-> megatron name/layout tables, one per family;
  :mod:`.hf_mapping_moe` — which rows a DeepSeek-style MoE configuration has;
  :mod:`.bridge_tables` (and ``bridge_tables.json``) — tables taken from Megatron-Bridge's
  registries.
* :mod:`.distopt_state` — distributed-optimizer state in model space (reshardable).
* :mod:`.dcp_reader` — any region of a tensor from a ``torch_dist`` checkpoint, chunk by chunk.
* :mod:`.safetensors_io` — memory-bounded safetensors reading and writing.
* :mod:`.value_model` — HF reward/value models (``*ForSequenceClassification``) as the
  critic's start.
* :mod:`.export` — live export of model chunks as HF-named tensors in buckets.
* :mod:`.convert` — offline HF <-> megatron converters (``tools/convert_*.py``).

Import the submodules; nothing heavy is imported here.
"""

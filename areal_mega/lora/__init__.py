"""LoRA for RL on the Megatron model: adapters on the attention and MLP linears, the reference
model for free (adapters off), PEFT adapter I/O and the checks that run before any work.

- :mod:`.targets` — which linears get adapters, in PEFT and Megatron-Bridge names, and the
  support checks (pure);
- :mod:`.layers` — the adapters on the Megatron model (Megatron-Bridge's canonical LoRA);
- :mod:`.actor` — the LoRA side of a run: adapters on the actor, the reference, adapter-only
  checkpoints, the weights the rollout servers get;
- :mod:`.peft_io` — adapters of a running model <-> HF PEFT files;
- :mod:`.ckpt_export` — offline export of a LoRA checkpoint as a PEFT adapter or a merged HF
  model (``tools/export_lora.py``).
"""

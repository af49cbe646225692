"""LoRA for RL on the Megatron model: adapters on the attention and MLP linears (Megatron-Bridge's
canonical LoRA, :mod:`areal_mega.lora.layers`), the reference model for free (adapters off), PEFT
adapter I/O (:mod:`areal_mega.lora.peft_io`) and the checks that run before any work
(:mod:`areal_mega.lora.targets`)."""

"""megatron-core on CPU-only torch, and its import without optional parts we do not use.

- :mod:`.megatron_cpu` — the patches that make megatron-core 0.19.2 run on CPU with gloo
  (applied only without CUDA; each checks the upstream source it replaces);
- :mod:`.patching` — one patch of megatron-core's source: described, checked, applied;
- :mod:`.cuda_shim` — the CPU stand-ins for ``torch.cuda`` those patches hand megatron's
  modules;
- :mod:`.cpu_gemm` — the tensor-parallel linears' three GEMMs through oneDNN (a speed patch);
- :mod:`.packed_rope` — RoPE over packed sequences in one call (a speed patch);
- :mod:`.main_grad` — a bf16 gradient added into its fp32 main gradient in cache-sized pieces,
  and a large weight's gradient added there as it is computed (speed patches);
- :mod:`.embedding_grad` — the word embedding's backward adding its rows straight into the
  main gradient (a speed patch);
- :mod:`.multi_tensor` — the optimizer's tensor-list scale and copy as ``_foreach`` ops (a
  speed patch);
- :mod:`.replicated_linear` — a torch stand-in for TransformerEngine's replicated linear, which
  megatron-core's DeepSeek sparse attention asks for;
- :mod:`.mamba_cpu` — torch versions of the Mamba-2 kernels megatron-core's ``MambaMixer``
  calls (causal-conv1d, mamba-ssm), packed sequences included;
- :mod:`.gdn_cpu` — torch versions of the fla kernels megatron-core's ``GatedDeltaNet``
  calls (causal convolution, L2 norm, chunked gated delta rule), packed sequences included;
- :mod:`.megatron_import` — megatron-core's first import without wandb (every device) and,
  without CUDA, with megatron's ``jit_fuser`` plain;
- :mod:`.bridge_import` — Megatron-Bridge imported one model family at a time (its package
  bodies import every family);
- :mod:`.scoped_import` — named modules whose bodies run inside a context of ours when first
  imported (the two modules above and below use it);
- :mod:`.te_placeholder` — a TransformerEngine placeholder seen only by Megatron-Bridge's one
  unconditional import.
"""

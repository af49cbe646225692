"""The CPU inference server: speaks SGLang's native HTTP protocol so the rollout client, the
launcher and the tests treat it like an SGLang server.

- :mod:`.server` -- the aiohttp app and ``python -m areal_mega.inference.server``;
- :mod:`.http_api` -- request parsing and validation (what a 400 names);
- :mod:`.server_state` -- the served model, its weight version, pause / resume, weight loads;
- :mod:`.decoding` -- continuous batching: prefill, decode steps, abort, resume;
- :mod:`.kv_cache` -- the per-row KV cache of the batched decoder;
- :mod:`.prefix_cache`, :mod:`.prefix_reuse` -- the radix tree of cached prefixes, and requests
  reusing the KV of a prefix already forwarded;
- :mod:`.sampling` -- temperature / top-p / top-k / seeded sampling, one row at a time safe;
- :mod:`.input_logprobs` -- input-token logprobs (``return_logprob``, teacher scoring);
- :mod:`.cpu_linear` -- oneDNN matmuls on prepacked weights;
- :mod:`.param_targets` -- where a checkpoint tensor goes in the served model (weight loads);
- :mod:`.model_support` -- which HF architectures the trainer and this server run;
- :mod:`.lora_adapters`, :mod:`.lora_api`, :mod:`.lora_layers` -- LoRA adapters: loading,
  SGLang's LoRA routes, the per-row LoRA forward;
- :mod:`.route_capture` -- the routed experts of every token of a MoE model (routing replay);
- :mod:`.process` -- starting CPU servers as processes.

SGLang's and vLLM's servers (GPU) are :mod:`areal_mega.backends`. It imports nothing from
rollout, backends, workflow, train or launch."""

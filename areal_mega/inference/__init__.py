"""The CPU inference server: speaks SGLang's native HTTP protocol so the rollout client, the
launcher and the tests treat it like an SGLang server.

- :mod:`.server` -- the aiohttp app and ``python -m areal_mega.inference.server``;
- :mod:`.http_api` -- request parsing and validation (what a 400 names);
- :mod:`.server_state` -- the served model, its weight version, pause / resume, weight loads;
- :mod:`.decoding` -- continuous batching: prefill, decode steps, abort, resume;
- :mod:`.kv_cache` -- the per-row KV cache of the batched decoder;
- :mod:`.sampling` -- temperature / top-p / top-k / seeded sampling, one row at a time safe;
- :mod:`.cpu_linear` -- oneDNN matmuls on prepacked weights;
- :mod:`.process` -- starting servers as processes (CPU) and SGLang's command line (GPU).

It imports nothing from rollout, workflow, train or launch."""

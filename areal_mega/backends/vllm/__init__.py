"""vLLM rollout servers.

- :mod:`.launch` -- the server's command line, environment and interpreter (vLLM lives in its
  own virtual environment);
- :mod:`.client` -- :class:`~.client.VLLMClient`: SGLang's native calls translated to vLLM's;
- :mod:`.auth` -- the ASGI middleware that asks for the API key on every route (runs in vLLM's
  process: standard library only);
- :mod:`.worker_extension` -- the class vLLM's workers mix in to receive weight updates (runs
  in vLLM's process; torch and vLLM imported inside its methods).

Imports nothing, so that vLLM's processes can import :mod:`.auth` and
:mod:`.worker_extension` alone."""

"""Rollout server backends (``rollout.backend``): each one's pieces in one place.

- :mod:`.clients` -- which client class speaks to which servers, and how their servers join the
  weight-update group;
- :mod:`.sglang` -- SGLang (GPU): ``python -m sglang.launch_server``'s command line (its client
  is :class:`~areal_mega.rollout.client.RolloutClient`, SGLang's native API);
- :mod:`.vllm` -- vLLM: the launcher, the client, the API-key middleware and the worker
  extension.

The CPU server (``local``) is :mod:`areal_mega.inference`. This ``__init__`` and
:mod:`.vllm`'s import nothing: vLLM's own processes import :mod:`.vllm.auth` and
:mod:`.vllm.worker_extension` from this checkout, with vLLM's Python and nothing of ours
installed."""

"""Which client speaks to which servers (``rollout.backend``).

- SGLang's native API (``sglang``, and our CPU server, ``local``):
  :class:`~areal_mega.rollout.client.RolloutClient`;
- vLLM (``vllm``): :class:`~areal_mega.backends.vllm.client.VLLMClient`, which translates
  SGLang's calls at the client's one HTTP seam.
"""

from __future__ import annotations

from areal_mega.backends.vllm.client import VLLMClient
from areal_mega.rollout.client import RolloutClient

__all__ = ["client_class", "group_handshake"]


def client_class(backend: str) -> type:
    """The :class:`RolloutClient` class for ``backend`` (local, sglang: SGLang's native API;
    vllm: :class:`VLLMClient`)."""
    return VLLMClient if backend == "vllm" else RolloutClient


def group_handshake(backend: str) -> str:
    """How the servers of ``backend`` build the weight-update group
    (:func:`areal_mega.parallel.weight_group.init_update_group`)."""
    return "vllm" if backend == "vllm" else "sglang"

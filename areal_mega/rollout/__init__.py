"""Rollout: the client of the inference servers and the rollout worker process.

- :mod:`.client` -- the client of SGLang's native HTTP API (also our CPU server's): routing,
  retries, pause / resume, weight updates on every server;
- :mod:`.generate_result` -- what one ``/generate`` call returns, and the client's errors;
- :mod:`.hooks` -- the client's hooks (relaunch tolerance, elastic membership, weight sender);
- :mod:`.server_pool` -- elastic membership: servers joining and leaving a running client;
- :mod:`.relaunch` -- a relaunched server re-synced to the current weights before it gets work;
- :mod:`.lora_sync` -- the published LoRA adapter loaded on (re)joining servers;
- :mod:`.controller` -- the rollout controller: bounded staleness, interruptible generation,
  :class:`~.controller.GroupContext` (what a workflow sees for one prompt group);
- :mod:`.staleness` -- the staleness bound (pure);
- :mod:`.failures` -- failed episodes: retry, drop, the failure-rate ceiling;
- :mod:`.counts` -- per-group counters carried from the worker to the trainer;
- :mod:`.resume` -- resume accounting (which drawn prompts the trainer already holds);
- :mod:`.routes` -- MoE routes returned by the servers (routing replay);
- :mod:`.scoring` -- prompt scoring on the servers (teacher logprobs);
- :mod:`.worker` -- the rollout worker process (``python -m areal_mega.rollout.worker``): the
  controller over the training prompts, workflows, evaluation and the data plane to the
  trainer. It is the one module of this package above :mod:`areal_mega.workflow` and
  :mod:`areal_mega.eval` in the package layers; nothing else here imports it.

The servers themselves are :mod:`areal_mega.inference` (CPU), SGLang or vLLM (GPU; their
pieces, the vLLM client included, are :mod:`areal_mega.backends`); what an episode does is
:mod:`areal_mega.workflow`; rewards are :mod:`areal_mega.rewards`."""

from areal_mega.rollout.client import (
    GenerateResult,
    RolloutClient,
    RolloutRequestError,
    RolloutServerError,
    sampling_dict,
)
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.failures import FailureRate, FailureRateExceeded
from areal_mega.rollout.hooks import ClientHooks
from areal_mega.rollout.staleness import (
    StalenessCounter,
    may_start,
    rollout_capacity,
    sample_version,
    staleness,
)

__all__ = [
    "ClientHooks",
    "GenerateResult",
    "RolloutClient",
    "RolloutRequestError",
    "RolloutServerError",
    "sampling_dict",
    "RolloutController",
    "FailureRate",
    "FailureRateExceeded",
    "StalenessCounter",
    "may_start",
    "rollout_capacity",
    "sample_version",
    "staleness",
]

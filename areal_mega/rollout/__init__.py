"""Rollout: the client of the inference servers (SGLang's native HTTP API), their elastic
membership and relaunch tolerance, the rollout controller with bounded staleness and
interruptible generation, what happens to failed episodes (retry, drop, failure-rate ceiling),
and resume accounting.

The servers themselves are :mod:`areal_mega.inference` (CPU) or SGLang (GPU); what an episode
does is :mod:`areal_mega.workflow`; rewards are :mod:`areal_mega.rewards`. The rollout worker
process, which puts these together with workflows, evaluation and the data plane, is
:mod:`areal_mega.rollout_worker` (above all of them in the package layers)."""
from areal_mega.rollout.client import (GenerateResult, RolloutClient, RolloutRequestError,
                                       RolloutServerError, sampling_dict)
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.failures import FailureRate, FailureRateExceeded
from areal_mega.rollout.hooks import ClientHooks
from areal_mega.rollout.staleness import (StalenessCounter, may_start, rollout_capacity,
                                          sample_version, staleness)

__all__ = ["ClientHooks", "GenerateResult", "RolloutClient", "RolloutRequestError",
           "RolloutServerError", "sampling_dict", "RolloutController", "FailureRate",
           "FailureRateExceeded", "StalenessCounter",
           "may_start", "rollout_capacity", "sample_version", "staleness"]

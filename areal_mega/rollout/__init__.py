"""Rollout: SGLang-compatible client, CPU rollout server, interruptible generation, the rollout
controller with bounded staleness, workflows and rewards, and the trainer-side weight sync."""
from areal_mega.rollout.client import (GenerateResult, RolloutClient, RolloutRequestError,
                                       RolloutServerError, sampling_dict)
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.staleness import (StalenessCounter, may_start, rollout_capacity,
                                          sample_version, staleness)
from areal_mega.rollout.weight_sync import (DistributedWeightSender, plan_weight_buckets)

__all__ = ["GenerateResult", "RolloutClient", "RolloutRequestError", "RolloutServerError",
           "sampling_dict", "RolloutController", "StalenessCounter", "may_start",
           "rollout_capacity", "sample_version", "staleness", "DistributedWeightSender",
           "plan_weight_buckets"]

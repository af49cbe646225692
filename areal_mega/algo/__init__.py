"""RL objectives as pure tensor functions over packed per-token data.

- :mod:`~areal_mega.algo.policy_loss` — decoupled PPO/GRPO/GSPO loss, the engine loss contract
  (:func:`make_policy_loss`) and :func:`finalize_stats`;
- :mod:`~areal_mega.algo.objectives` — the per-token objectives besides PPO's clipped
  surrogate (CISPO, SAPO);
- :mod:`~areal_mega.algo.advantages` — reward shaping, GRPO group normalisation, REINFORCE and
  GAE advantages (:func:`compute_advantages`);
- :mod:`~areal_mega.algo.estimators` — verl's rloo, opo, grpo_passk and
  reinforce_plus_plus(_baseline) estimators as pure functions (dispatched by
  :func:`compute_advantages`);
- :mod:`~areal_mega.algo.kl` — k1/k2/k3 KL estimators;
- :mod:`~areal_mega.algo.filters` — dynamic sampling (drop uniform-reward groups);
- :mod:`~areal_mega.algo.trajectories` — filtering and advantages on the step's trajectories,
  before packing (what the trainer runs);
- :mod:`~areal_mega.algo.value_loss` — the critic's clipped value loss and its statistics;
- :mod:`~areal_mega.algo.distill` — on-policy distillation: the teacher's per-token reverse-KL
  signal as an advantage;
- :mod:`~areal_mega.algo.packing` — packed-batch helpers (segment sums, selection, splitting);
- :mod:`~areal_mega.algo.batch` — :class:`PackedBatch`, the typed RL micro-batch.
"""

from areal_mega.algo.advantages import (
    compute_advantages,
    group_normalize,
    masked_whiten,
    outcome_token_rewards,
    overlong_penalty,
    shape_rewards,
)
from areal_mega.algo.batch import PackedBatch
from areal_mega.algo.filters import dynamic_filter, group_filter, uniform_groups
from areal_mega.algo.kl import kl_estimate
from areal_mega.algo.packing import (
    broadcast_to_tokens,
    group_index_of,
    last_token_index,
    segment_sum,
    select_sequences,
    split_micro_batches,
    token_seq_ids,
    with_algo_fields,
)
from areal_mega.algo.policy_loss import (
    aggregate_loss,
    behav_importance_weight,
    clipped_surrogate,
    finalize_stats,
    loss_denominator,
    make_policy_loss,
    policy_loss,
    ppo_ratio,
)
from areal_mega.algo.trajectories import (
    filter_trajectories,
    sequence_fields,
    sequence_rewards,
    trajectory_advantages,
)

__all__ = [
    "aggregate_loss",
    "behav_importance_weight",
    "broadcast_to_tokens",
    "clipped_surrogate",
    "compute_advantages",
    "dynamic_filter",
    "filter_trajectories",
    "finalize_stats",
    "group_filter",
    "group_index_of",
    "group_normalize",
    "kl_estimate",
    "last_token_index",
    "loss_denominator",
    "make_policy_loss",
    "masked_whiten",
    "outcome_token_rewards",
    "overlong_penalty",
    "PackedBatch",
    "policy_loss",
    "ppo_ratio",
    "segment_sum",
    "select_sequences",
    "sequence_fields",
    "sequence_rewards",
    "shape_rewards",
    "split_micro_batches",
    "token_seq_ids",
    "trajectory_advantages",
    "uniform_groups",
    "with_algo_fields",
]

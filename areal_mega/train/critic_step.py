"""The critic's part of an RL step and of the trainer session (``critic.enabled``).

* :func:`build_critic` — the :class:`~areal_mega.engine.critic.CriticEngine` on the session's
  mesh; :func:`init_critic` / :func:`load_critic` / :func:`save_critic` — its initial weights
  and its checkpoints (``<checkpoint root>/critic/iter_<step>``, saved just before the actor's
  so that every actor checkpoint has its critic).
* :func:`gae_step` — values of this rank's micro-batches, GAE on each packed micro-batch with
  :func:`areal_mega.ops.packed_gae` (through :func:`~areal_mega.algo.advantages.
  compute_advantages`: reward shaping, KL in the reward, γ, λ, bootstrap values for truncated
  samples, loss masks for multi-turn), advantage whitening over all DP ranks.
* :func:`train_critic` — ``critic.ppo_n_minibatches`` optimizer steps of the clipped value loss.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from areal_mega.algo.advantages import EPS, compute_advantages
from areal_mega.algo.value_loss import finalize_value_stats, make_value_loss
from areal_mega.dataplane.trajectory import FINISH_REASONS
from areal_mega.run_dir import iter_dir_name
from areal_mega.train import batches

__all__ = [
    "build_critic",
    "init_critic",
    "load_critic",
    "save_critic",
    "critic_root",
    "gae_step",
    "train_critic",
]


def build_critic(cfg, mesh):
    """The critic engine of ``cfg`` (its HF directory ``critic.path`` or ``model.path``)."""
    from areal_mega.engine.critic import CriticEngine, critic_optimizer_config

    return CriticEngine(
        cfg.model,
        hf_config=cfg.critic.path or cfg.model.path,
        mesh=mesh,
        optimizer_cfg=critic_optimizer_config(cfg.optimizer, cfg.critic),
        seed=cfg.seed,
        total_train_steps=cfg.total_steps,
    )


def critic_root(ckpt_root) -> Path:
    """Where the critic's checkpoints live, under the run's checkpoint root."""
    return Path(ckpt_root) / "critic"


def init_critic(critic, load_trunk, hf_dir: str) -> None:
    """Initial critic weights: ``load_trunk(views, hf_dir)`` loads an LM checkpoint of
    ``hf_dir`` into the trunk (:class:`~areal_mega.engine.critic.TrunkView`s; the session's
    HF → Megatron conversion), then a ``score`` head of ``hf_dir`` (a reward/value model), if
    any, replaces the fresh value head."""
    from areal_mega.engine.critic import TrunkView, load_score_head

    load_trunk([TrunkView(c) for c in critic.model_chunks()], hf_dir)
    if hasattr(critic.optimizer, "reload_model_params"):
        critic.optimizer.reload_model_params()
    load_score_head(critic, hf_dir)


def save_critic(critic, ckpt_root, step: int, keep_last: int) -> None:
    """Save the critic (model, optimizer, LR schedule) as ``<critic root>/iter_<step>``."""
    from areal_mega.checkpoint.dist_ckpt import save_checkpoint

    save_checkpoint(
        critic_root(ckpt_root),
        step,
        critic.model_chunks(),
        critic.optimizer,
        critic.lr_scheduler,
        extra={"step": step},
        keep_last=keep_last,
    )


def load_critic(critic, ckpt_root, step: int) -> None:
    """Restore the critic saved with the actor checkpoint of ``step``; a FileNotFoundError
    names the missing directory (a run checkpointed without a critic)."""
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint

    path = critic_root(ckpt_root) / iter_dir_name(step)
    if not path.is_dir():
        raise FileNotFoundError(
            f"critic.enabled=true but the checkpoint of step {step} has no "
            f"critic ({path} is missing)"
        )
    load_checkpoint(
        path, critic.model_chunks(), critic.optimizer, critic.lr_scheduler, load_rng=False
    )
    critic.step_count = step


def _bootstrap_values(mb, values: torch.Tensor) -> torch.Tensor:
    """V after the last token of each sample cut by ``max_new_tokens`` (0 for the others):
    the critic's output at the sequence's last position."""
    starts = torch.as_tensor(mb["cu_seqlens_padded"]).long()[:-1]
    last = starts + torch.as_tensor(mb["seqlens"]).long() - 1
    truncated = torch.as_tensor(mb["finish_codes"]) == FINISH_REASONS.index("length")
    return torch.where(truncated, values[last], torch.zeros_like(values[last]))


def gae_inputs(mb, values: torch.Tensor, *, bootstrap_truncated: bool) -> dict:
    """The packed micro-batch as :func:`compute_advantages` reads it for GAE: its per-token
    fields in the (padded) packed layout, the critic's ``values`` and, with
    ``bootstrap_truncated``, ``bootstrap_values``."""
    keys = (
        "loss_mask",
        "rewards",
        "response_lens",
        "seq_no_eos",
        "group_index",
        "logprobs",
        "prox_logprobs",
        "ref_logprobs",
    )
    out = {k: mb[k] for k in keys if mb.get(k) is not None}
    out["cu_seqlens"] = torch.as_tensor(mb["cu_seqlens_padded"])
    out["values"] = values
    if bootstrap_truncated:
        out["bootstrap_values"] = _bootstrap_values(mb, values)
    return out


def _dp_sum(t: torch.Tensor, mesh) -> torch.Tensor:
    if mesh.dims.dp > 1:
        t = t.to(mesh.device)
        dist.all_reduce(t, group=mesh.dp_group)
    return t.cpu()


def gae_step(critic, mbs: list, cfg, mesh) -> tuple[list, dict]:
    """Values, GAE advantages and returns of this rank's micro-batches (after ``prox_logprobs``
    and ``ref_logprobs`` are attached). Returns ``(new micro-batches with values, returns and
    advantages attached, stats)``; stats (identical on every rank) are over the whole step's
    loss tokens: ``adv/advantage_mean``, ``adv/advantage_std`` (before whitening),
    ``adv/kl_reward_mean`` (KL in the reward), ``critic/old_value_mean``,
    ``critic/gae_return_mean``. Collective over the trainer ranks."""
    algo = dataclasses.replace(cfg.algorithm, batch_norm=False)  # whitened globally below
    values = critic.forward_values(mbs)
    advs, rets = [], []
    sums = torch.zeros(6, dtype=torch.float64)  # n, Σa, Σa², ΣV, ΣR, Σkl·n
    for mb, v in zip(mbs, values):
        out, st = compute_advantages(
            gae_inputs(mb, v, bootstrap_truncated=cfg.critic.bootstrap_truncated),
            algo,
            max_response_len=cfg.rollout.max_new_tokens,
        )
        m = torch.as_tensor(mb["loss_mask"]).bool()
        a = out["advantages"].double()
        n = float(m.sum())
        sums += torch.tensor(
            [
                n,
                float(a[m].sum()),
                float((a[m] ** 2).sum()),
                float(v.double()[m].sum()),
                float(out["returns"].double()[m].sum()),
                st.get("kl_reward_mean", 0.0) * n,
            ],
            dtype=torch.float64,
        )
        advs.append(out["advantages"])
        rets.append(out["returns"])
    n, sa, sa2, sv, sr, skl = _dp_sum(sums, mesh).tolist()
    n_safe = max(n, 1.0)
    mean = sa / n_safe
    var = (sa2 - n * mean * mean) / max(n - 1.0, 1.0)  # unbiased, as masked_whiten
    std = max(var, 0.0) ** 0.5
    if cfg.algorithm.batch_norm:
        advs = [
            torch.where(
                torch.as_tensor(mb["loss_mask"]).bool(),
                (a - mean) / (std + EPS),
                torch.zeros_like(a),
            )
            for mb, a in zip(mbs, advs)
        ]
    stats = {}
    if n > 0:  # means over no loss token are left out (std: fewer than two)
        stats = {
            "adv/advantage_mean": mean,
            "critic/old_value_mean": sv / n,
            "critic/gae_return_mean": sr / n,
        }
        if n > 1:
            stats["adv/advantage_std"] = std
        if cfg.algorithm.kl_in_reward and cfg.algorithm.kl_coef > 0:
            stats["adv/kl_reward_mean"] = skl / n
    mbs = batches.attach(mbs, values=values, returns=rets, advantages=advs)
    return mbs, stats


def train_critic(critic, mbs: list, cfg) -> dict:
    """``critic.ppo_n_minibatches`` optimizer steps of the value loss on this rank's
    micro-batches (with ``values`` and ``returns``). Returns ``critic/*`` stats: the
    finalised sums of :func:`~areal_mega.algo.value_loss.finalize_value_stats` (value loss,
    clip fraction, value and return means, explained variance), ``loss``, ``grad_norm``, ``lr``."""
    loss_fn, den_fn = make_value_loss(cfg.critic)
    per = [
        critic.train_batch(mb_group, loss_fn, den_fn)
        for mb_group in batches.minibatches(
            mbs, cfg.critic.ppo_n_minibatches, critic.micro_batch_multiple
        )
    ]
    merged = batches.merge_train_stats(per, finalize_value_stats)
    return {f"critic/{k}": v for k, v in merged.items()}

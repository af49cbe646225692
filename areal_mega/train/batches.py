"""From finished trajectories to this rank's packed micro-batches (trainer side).

Rank 0 owns the trajectory buffer. For one training step it
1. drops uniform-reward groups when dynamic filtering is on,
2. computes advantages over whole prompt groups (GRPO needs every sample of a group) on the
   trajectories themselves, in their own token layout, before anything is packed,
3. moves every per-token field into the *next-token layout* the engine uses (position t holds
   the data of token t+1: its id as ``labels``, its loss-mask bit, behaviour logprob,
   advantage, version), because ``MegatronEngine.forward_logprobs`` returns at
   position t the logprob of ``labels[t]`` (:func:`next_token_layout`, the only shift),
4. plans micro-batches (Karmarkar-Karp over DP ranks, token budget, equal counts, PP multiple),
5. packs each micro-batch padded to TP (2·TP·CP with context parallelism) into a typed
   :class:`~areal_mega.algo.batch.PackedBatch`,
and :func:`distribute` scatters the :class:`StepPlan` so every rank receives only its DP
rank's share (every rank of one DP replica — its TP, CP and PP ranks — gets the same share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from areal_mega.algo.batch import PackedBatch
from areal_mega.algo.trajectories import filter_trajectories, trajectory_advantages
from areal_mega.dataplane.multimodal import image_tokens
from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.rollout.counts import carried_counts
from areal_mega.scheduler import PlanError, plan_micro_batches
from areal_mega.scheduler.packing import PER_TOKEN_FILL, pack_sequences
from areal_mega.scheduler.shared_prefix import plan_grouped_micro_batches


@dataclass
class StepPlan:
    """Rank 0's plan of one training step (built by :func:`plan_step`; plain data).

    ``micro_batches[d]`` is DP rank d's list of packed micro-batches; every DP rank holds the
    same number of them (each rank runs the same pipeline schedule and optimizer steps)."""

    micro_batches: list  # [dp_size][n_micro_batches] PackedBatch (SFT: packed dicts)
    sample_ids: list  # every sample trained this step (all DP ranks)
    stats: dict  # advantage / filter / staleness statistics
    advantages: dict = field(default_factory=dict)  # sample id -> mean advantage (samples log)

    def __post_init__(self):
        counts = {len(mbs) for mbs in self.micro_batches}
        if not self.micro_batches or len(counts) != 1:
            raise ValueError(
                f"StepPlan: every DP rank needs the same number of micro-batches, "
                f"got {[len(m) for m in self.micro_batches]}"
            )

    @property
    def dp_size(self) -> int:
        """Number of DP ranks the plan is for."""
        return len(self.micro_batches)

    def share(self, dp_rank: int) -> "StepBatch":
        """What DP rank ``dp_rank`` trains on: its micro-batches and the step's statistics."""
        return StepBatch(micro_batches=self.micro_batches[dp_rank], stats=self.stats)


@dataclass
class StepBatch:
    """One rank's share of a training step (see :meth:`StepPlan.share`)."""

    micro_batches: list  # this DP rank's packed micro-batches
    stats: dict  # the step's batch statistics (rank 0's view, same everywhere)


def next_token_layout(input_ids: np.ndarray, **per_token: np.ndarray) -> dict:
    """The one next-token shift, for RL and SFT: a packable dict with ``input_ids`` as given,
    ``labels`` = the next token of the same sequence (``labels[t] = input_ids[t+1]``, -1 after
    the last token: the engine's targets, :meth:`MegatronEngine.forward_logprobs` returns at
    position t the logprob of ``labels[t]``) and every per-token field moved alike
    (``out[t] = field[t+1]``); the last position gets the field's padding value
    (:data:`~areal_mega.scheduler.packing.PER_TOKEN_FILL`, else 0). So position t's logprob
    and position t's fields describe the same token."""
    if "labels" in per_token:
        raise ValueError("next_token_layout: 'labels' is derived from input_ids, do not pass it")
    ids = np.asarray(input_ids)
    out = {"input_ids": input_ids}
    for name, arr in {"labels": ids.astype(np.int64), **per_token}.items():
        arr = np.asarray(arr)
        shifted = np.empty_like(arr)
        shifted[:-1] = arr[1:]
        if len(arr):
            shifted[-1] = PER_TOKEN_FILL.get(name, 0)
        out[name] = shifted
    return out


def next_token_sample(traj: Trajectory, advantages: np.ndarray) -> dict:
    """A packable dict for ``traj``: its per-token fields in next-token layout
    (:func:`next_token_layout`) and its per-sequence data. The MoE routes
    (``token_extras["routed_experts"]`` [L, layers, topk], routing replay) describe each token
    as a model input, so they stay in the layout of ``input_ids``, unshifted; so do the
    prompt's images (``multimodal``, and ``meta["image_data"]``: the same images as sent to
    the servers), which the packed micro-batch carries in packed order."""
    routes = traj.token_extras.get("routed_experts")
    return {
        **next_token_layout(
            traj.input_ids,
            loss_mask=traj.loss_mask,
            logprobs=traj.logprobs,
            versions=traj.versions,
            advantages=advantages.astype(np.float32),
        ),
        **({} if routes is None else {"routed_experts": np.asarray(routes)}),
        "multimodal": traj.multimodal,  # the prompt's images (packed apart: pack_images)
        # and as the prompt sent them to the servers (a served teacher scores with them)
        "image_data": traj.meta.get("image_data") if traj.multimodal else None,
        "prompt_len": traj.prompt_len,
        "reward": traj.total_reward,
        "sample_id": traj.sample_id,
        "group_id": traj.group_id,
        "finish_reason": traj.finish_reason,
    }


def budget_lengths(trajs: Sequence[Trajectory], vision=None) -> list:
    """Each sample's cost against ``scheduler.max_tokens_per_mb`` (and in DP balancing): its
    tokens, plus for a sample with images its vision tower's work counted as one token per
    merged patch, ``sum(t·h·w) / merge_size²`` (``vision``: the model's
    :class:`~areal_mega.dataplane.multimodal.VisionSpec`). So an image token counts twice:
    once in the language model and once for the ``merge_size²`` patches the vision tower runs
    on it, whose cost per patch is a few times lower (a narrower, but as deep, transformer:
    Qwen2.5-VL-7B's tower has width 1280 for the language model's 3584)."""
    if vision is None:
        return [t.length for t in trajs]
    return [t.length + image_tokens(t.multimodal, vision.merge_size) for t in trajs]


def group_advantages(
    trajs: Sequence[Trajectory], algo_cfg, *, max_response_len: int
) -> tuple[list, list, dict]:
    """Filter and compute per-token advantages over a list of whole groups, on the
    trajectories themselves (:mod:`areal_mega.algo.trajectories`), before any packing.

    Returns (kept trajectories, their per-token advantage arrays in trajectory layout, stats)."""
    kept, fstats = filter_trajectories(trajs, algo_cfg.dynamic_filter)
    stats = {f"filter/{k}": float(v) for k, v in fstats.items()}
    if not kept:
        return [], [], stats
    if algo_cfg.adv_estimator == "gae":  # needs the critic's values: computed in the step
        return kept, [np.zeros(len(t.input_ids), np.float32) for t in kept], stats
    advs, astats = trajectory_advantages(kept, algo_cfg, max_response_len=max_response_len)
    stats.update({f"adv/{k}": float(v) for k, v in astats.items()})
    return kept, advs, stats


def per_source_rewards(trajs: Sequence[Trajectory]) -> dict:
    """``{"reward/<source>": mean}`` over the trajectories that carry ``meta["source"]``
    (multi-task runs); sources absent from this step are absent from the result."""
    by_source: dict = {}
    for t in trajs:
        name = t.meta.get("source")
        if isinstance(name, str) and name:
            by_source.setdefault(name, []).append(t.total_reward)
    return {f"reward/{k}": float(np.mean(v)) for k, v in sorted(by_source.items())}


def plan_step(
    trajs: Sequence[Trajectory],
    cfg,
    *,
    dp_size: int,
    tp_size: int,
    pp_size: int,
    cp_size: int,
    share_prefix: bool = False,
    template: Optional[Trajectory] = None,
    vision=None,
) -> StepPlan:
    """Rank-0 planning of one step: micro-batches per DP rank, sample ids and statistics.
    ``vision``: a vision-language model's :class:`~areal_mega.dataplane.multimodal.VisionSpec`
    (the token budget counts the vision tower's work, :func:`budget_lengths`; every
    micro-batch carries its samples' images in packed order).
    ``share_prefix``: the engines compute shared prompts once (the samples of a prompt group
    are planned together and the budget counts the tokens computed). ``template``: a
    trajectory whose fields the padding micro-batches carry when ``trajs`` is empty (every
    sample of the step refused by the entry checks)."""

    kept, advs, stats = group_advantages(
        trajs, cfg.algorithm, max_response_len=cfg.rollout.max_new_tokens
    )
    rewards = np.array([t.total_reward for t in trajs], dtype=np.float64)
    if len(rewards):  # means over no sample are left out of the row
        stats["reward/mean"] = float(rewards.mean())
        stats["reward/std"] = float(rewards.std())
    stats.update(per_source_rewards(trajs))
    stats.update(carried_counts(trajs))  # the rollout side's counters, once per group
    resp = [t.length - t.prompt_len for t in trajs]
    if resp:
        stats["response_len/mean"] = float(np.mean(resp))
    samples = [next_token_sample(t, a) for t, a in zip(kept, advs)]
    seqlens = [len(s["input_ids"]) for s in samples]
    budget = budget_lengths(kept, vision)
    plan_kw = dict(
        dp_size=dp_size,
        max_tokens_per_mb=cfg.scheduler.max_tokens_per_mb,
        pp_size=pp_size,
        min_micro_batches=cfg.scheduler.min_micro_batches,
        balance_by=cfg.scheduler.balance_by,
        flops_linear_coef=cfg.scheduler.flops_linear_coef,
    )
    try:
        plan = (
            plan_grouped_micro_batches(
                [s["input_ids"] for s in samples],
                [s["labels"] for s in samples],
                [s["loss_mask"] for s in samples],
                **plan_kw,
            )
            if share_prefix
            else plan_micro_batches(budget, **plan_kw)
        )
    except PlanError as e:
        if vision is None:
            raise
        raise PlanError(
            f"{e} (with images a sample's length is its tokens plus sum(t*h*w)/merge_size^2 "
            "for its vision tower's work: train.batches.budget_lengths)"
        ) from None
    pad_to = tp_size * (2 * cp_size if cp_size > 1 else 1)
    # an empty micro-batch (a DP rank with fewer samples than micro-batches, or a step whose
    # every group the dynamic filter dropped) is padding carrying every field of the step's
    # samples, so it trains with zero weight
    first = trajs[0] if trajs else template
    like = (
        samples[0]
        if samples
        else next_token_sample(first, np.zeros(first.length, np.float32))
        if first
        else None
    )
    per_rank = [
        [
            PackedBatch.from_packed(
                pack_sequences(
                    [samples[i] for i in idx], pad_to_multiple=pad_to, cp_size=cp_size, like=like
                )
            )
            for idx in rank_plan
        ]
        for rank_plan in plan
    ]
    generated = [t for t in kept if t.min_version >= 0]
    if generated:
        stats["versions/min"] = float(min(t.min_version for t in generated))
        stats["versions/max"] = float(max(t.max_version for t in generated))
    stats["n_samples"] = float(len(kept))
    stats["n_tokens_total"] = float(sum(seqlens))
    if vision is not None:
        stats["n_images"] = float(sum(t.n_images for t in kept))
    stats["n_micro_batches"] = float(len(plan[0]) if plan else 0)
    return StepPlan(
        micro_batches=per_rank,
        sample_ids=[t.sample_id for t in kept],
        stats=stats,
        advantages=sample_advantages(kept, advs),
    )


def sample_advantages(kept: Sequence[Trajectory], advs: Sequence[np.ndarray]) -> dict:
    """Sample id -> the mean advantage over its trained tokens (0 without any)."""
    out = {}
    for t, a in zip(kept, advs):
        mask = np.asarray(t.loss_mask, dtype=bool)
        out[t.sample_id] = float(np.asarray(a)[mask].mean()) if mask.any() else 0.0
    return out


def distribute(plan: Optional[StepPlan], mesh) -> StepBatch:
    """Hand every trainer rank its own share of rank 0's ``plan`` (None on other ranks).

    Rank 0 scatters one :class:`StepBatch` per global rank — the micro-batches of that rank's
    DP rank (:meth:`ParallelMesh.dp_ranks_by_global_rank`) — so a rank receives only its own
    micro-batches, never the other DP ranks'. Collective over the trainer's default group
    (torch's object scatter never leaves the trainer's own process group)."""
    import torch.distributed as dist

    if mesh.world_size == 1:
        return plan.share(0)
    shares = None
    if mesh.rank == 0:
        if plan.dp_size != mesh.dims.dp:
            raise ValueError(
                f"StepPlan has {plan.dp_size} DP shares, the mesh has dp={mesh.dims.dp}"
            )
        shares = [plan.share(d) for d in mesh.dp_ranks_by_global_rank()]
    out = [None]
    dist.scatter_object_list(out, shares, src=0)
    return out[0]


def attach(micro_batches: list, **per_micro_batch: list) -> list:
    """New micro-batches with per-micro-batch values attached (e.g. ``prox_logprobs=[...]``,
    one entry per micro-batch) through :meth:`PackedBatch.with_fields`; the inputs are left
    unchanged."""
    out = list(micro_batches)
    for key, values in per_micro_batch.items():
        if len(values) != len(out):
            raise ValueError(
                f"attach: {len(values)} values of {key!r} for {len(out)} micro-batches"
            )
        out = [mb.with_fields(**{key: v}) for mb, v in zip(out, values)]
    return out


def minibatches(micro_batches: list, n: int, multiple_of: int = 1) -> list:
    """Split a rank's micro-batches into ``n`` PPO minibatches (one optimizer step each).

    Every rank holds the same number of micro-batches, so every rank takes the same number
    of optimizer steps; with fewer micro-batches than ``n`` the count is reduced.
    ``multiple_of``: every minibatch holds a multiple of it (the engine's
    ``micro_batch_multiple``: PP under the interleaved pipeline schedule); the number of
    micro-batches must then be a multiple of it too."""
    if multiple_of < 1 or len(micro_batches) % multiple_of:
        raise ValueError(
            f"{len(micro_batches)} micro-batches cannot be split into minibatches "
            f"of a multiple of multiple_of={multiple_of}"
        )
    units = len(micro_batches) // multiple_of
    n = max(1, min(n, units))
    bounds = [round(i * units / n) * multiple_of for i in range(n + 1)]
    return [micro_batches[bounds[i] : bounds[i + 1]] for i in range(n)]


def merge_train_stats(per_minibatch: list, finalize) -> dict:
    """Engine stats of each minibatch -> one dict: loss-function sums are added and finalised
    into means/fractions; ``loss``/``grad_norm`` are averaged; ``lr`` is the last one.
    ``ppo_kl/first_minibatch`` keeps the first minibatch's ``ppo_kl`` (0 on-policy).
    A minibatch the engine skipped (``skipped``: its loss or gradients non-finite, no update
    applied) is left out of those means and counted in ``skipped_minibatches`` (with
    ``nonfinite_loss`` / ``nonfinite_grad``: how many had each); when every one was
    skipped only ``lr`` and those counts remain."""
    if not per_minibatch:
        return {}
    engine_keys = {
        "loss",
        "grad_norm",
        "lr",
        "n_tokens",
        "update_successful",
        "skipped",
        "nonfinite_loss",
        "nonfinite_grad",
    }
    applied = [st for st in per_minibatch if not st.get("skipped")]
    out: dict = {}
    if len(applied) < len(per_minibatch):
        skipped = [st for st in per_minibatch if st.get("skipped")]
        out["skipped_minibatches"] = float(len(skipped))
        for k in ("nonfinite_loss", "nonfinite_grad"):
            out[k] = float(sum(st.get(k, 0.0) for st in skipped))
    out["lr"] = float(per_minibatch[-1]["lr"])
    if not applied:
        return out
    summed: dict = {}
    for st in applied:
        for k, v in st.items():
            if k not in engine_keys:
                summed[k] = summed.get(k, 0.0) + float(v)
    out.update({k: float(v) for k, v in finalize(summed).items()})
    n = len(applied)
    out["loss"] = sum(float(s["loss"]) for s in applied) / n
    out["grad_norm"] = sum(float(s["grad_norm"]) for s in applied) / n
    first = finalize({k: float(v) for k, v in applied[0].items() if k not in engine_keys})
    if "ppo_kl" in first:
        out["ppo_kl/first_minibatch"] = float(first["ppo_kl"])
    return out

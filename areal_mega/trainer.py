"""The asynchronous RL trainer (and SFT on the same engine).

Launch (normally via ``python -m areal_mega.launch.local --config recipes/tiny-cpu.yaml``, which
also starts the rollout servers and the rollout worker)::

    torchrun --nproc-per-node N -m areal_mega.trainer --config recipes/X.yaml [key=value ...]

One RL step: take the oldest finished prompt groups from the buffer -> advantages -> proximal
(and reference) logprobs recomputed -> PPO/GRPO update -> weights to the rollout servers ->
version + 1 -> log -> checkpoint every ``checkpoint.save_every`` steps.
"""

from __future__ import annotations

import argparse
import sys
import time

from areal_mega.algo import finalize_stats, make_policy_loss
from areal_mega.common.proc_memory import proc_status_bytes
from areal_mega.config import check_against_model, load_config
from areal_mega.run_dir import FATAL_EXIT_CODE
from areal_mega.train import batches, evaluation
from areal_mega.train.nonfinite import NonFiniteStepsError
from areal_mega.train.quarantine import record_crash
from areal_mega.train.routing import free_routing_due, routing_metrics
from areal_mega.train.screen import screen_samples
from areal_mega.train.session import CheckpointSaveError, TrainerSession
from areal_mega.train.teacher import opd_step


def rl_step(s: TrainerSession, step: int) -> dict:
    """Run RL step ``step`` (1-based) on this trainer rank; every rank calls it, in lockstep.

    1. Rank 0 takes the ``rollout.batch_size`` oldest complete prompt groups from the intake
       (blocking until they arrive), drops the samples the entry checks refuse (non-finite
       reward or rollout logprobs, unusable routes: ``train.screen``, ``refused/*``),
       filters them, computes advantages and plans packed
       micro-batches for every DP rank (``batches.plan_step``, a ``StepPlan``); each rank
       receives only its DP rank's share (``batches.distribute``).
    2. Forward passes: ``prox_logprobs`` from the actor (the weights of version ``step − 1``;
       skipped when the training forward provides them, :func:`prox_forward_needed`)
       and, with a reference model, ``ref_logprobs``; both are attached to the micro-batches
       (``batches.attach``, new ``PackedBatch`` objects), as is ``policy_version = step − 1``.
       With ``algorithm.routing_replay: r3`` the actor replays the rollout's MoE routes, and
       when due one more actor forward routes freely for the ``moe/*`` metrics
       (``train.routing.routing_metrics``).
    With a critic (``critic.enabled``, GAE): the critic's values, then GAE advantages and
       returns (``train.critic_step.gae_step``) are attached too; the critic trains on the
       value loss after the actor (``train_critic``); during ``critic.warmup_steps`` the actor
       does not train.
    With ``algorithm.opd`` (on-policy distillation, ``train.teacher.opd_step``): the teacher's
       logprobs are attached and the OPD term replaces or joins the advantages (after GAE).
    With a vision-language student (``s.vision``) every micro-batch carries its samples'
       images in packed order, so the proximal, reference, teacher and training forwards all
       see them; the token budget counts the vision tower's work (``batches.budget_lengths``).
    3. The loss is built from ``cfg.algorithm`` by ``make_policy_loss`` (so every algorithm key,
       e.g. ``kl_clamp``, reaches it here) and the actor takes ``actor.ppo_n_minibatches``
       optimizer steps (``train_batch``, collective over the trainer ranks). A step the
       dynamic filter left without samples takes no optimizer step (``n_samples`` 0, no
       ``loss`` in its row). An optimizer step whose loss or gradients are non-finite on any
       rank is skipped on every rank (``train/skipped``, ``train/skipped_steps``,
       ``train/skip_reason/<source>``; ``train.nonfinite``); ``actor.max_consecutive_skips``
       in a row stop the run (``NonFiniteStepsError``, fatal).
    4. ``s.publish_weights(version=step)`` sends the new weights to the rollout servers; then
       rank 0 appends the trained sample ids to the intake's trained log.

    Side effects: the actor's weights, optimizer and LR schedule advance; the servers serve
    ``step``; the planned micro-batches are not mutated (fields are attached to copies,
    ``PackedBatch.with_fields``). No metrics row or checkpoint (the caller's loop does
    both); rank 0 writes the step's sample groups when ``logging.log_samples_every`` is due. Returns
    the step's statistics (identical on every rank): rank 0's batch
    statistics (filter, advantages, rewards, versions, sizes), ``opd/*`` and ``time/teacher``
    (part of ``time/logprobs``) with OPD, the finalised loss statistics merged over
    minibatches (``finalize_stats``), ``version`` = ``step``, the ``time/*`` split,
    ``tokens/s`` and ``mem/trainer_peak_rss_gib``.
    """
    cfg, t0 = s.cfg, time.time()
    trajs = s.intake.next_groups(cfg.rollout.batch_size) if s.is_rank0 else None  # start order
    if s.is_rank0:  # bad rewards / logprobs / routes: the sample is dropped and counted
        trajs, refused, dropped = screen_samples(trajs, s.intake.route_layout, s.intake.quarantine)
        plan = batches.plan_step(
            trajs, cfg, **s.layout, template=dropped[0] if dropped else None, vision=s.vision
        )
        plan.stats.update(refused)
    else:
        plan = None
    if s.is_rank0:  # samples.jsonl + tracker tables when logging.log_samples_every is due
        s.logger.log_samples(step, trajs, plan.advantages)
    batch = batches.distribute(plan, s.mesh)
    t_data = time.time()
    mbs = batch.micro_batches  # PackedBatch: attaching returns new batches (no mutation)
    # no sample left (the dynamic filter dropped every group): no optimizer step, no weight
    # decay on zero gradients; the version still advances so the rollout side goes on
    has_samples = batch.stats.get("n_samples", 0) > 0
    actor_trains = has_samples and (s.critic is None or step > cfg.critic.warmup_steps)
    # the actor's optimizer steps, as micro-batch indices (attaching below makes new batches)
    updates = (
        batches.minibatches(
            list(range(len(mbs))), cfg.actor.ppo_n_minibatches, s.actor.micro_batch_multiple
        )
        if actor_trains
        else []
    )
    recompute = prox_forward_needed(cfg, step, len(updates))
    # the weights that compute prox_logprobs (for the mismatch metric)
    mbs = batches.attach(mbs, policy_version=[step - 1] * len(mbs))
    if recompute:
        mbs = batches.attach(
            mbs, prox_logprobs=s.actor.forward_logprobs(mbs, temperature=cfg.actor.temperature)
        )
    moe_stats = routing_metrics(
        s.actor, mbs, step=step, algo_cfg=cfg.algorithm, temperature=cfg.actor.temperature
    )  # R3: free routing
    if s.ref is not None:
        mbs = batches.attach(
            mbs, ref_logprobs=s.ref.forward_logprobs(mbs, temperature=cfg.actor.temperature)
        )
    critic_stats = {}
    if s.critic is not None:  # values, GAE (after the reference forward), value loss
        from areal_mega.train.critic_step import gae_step, train_critic

        mbs, critic_stats = gae_step(s.critic, mbs, cfg, s.mesh)
    mbs, opd_stats = opd_step(s, mbs)  # OPD: teacher logprobs, the reverse-KL advantage
    t_fwd = time.time()
    loss_fn, denominator_fn = make_policy_loss(
        cfg.algorithm, max_response_len=cfg.rollout.max_new_tokens, prox_from_forward=not recompute
    )
    train_stats = []
    for indices in updates:
        train_stats.append(
            s.actor.train_batch(
                [mbs[i] for i in indices],
                loss_fn,
                denominator_fn,
                temperature=cfg.actor.temperature,
                return_entropy=True,
            )
        )
    if s.critic is not None and has_samples:
        critic_stats.update(train_critic(s.critic, mbs, cfg))
    t_train = time.time()
    # after a skipped step the weights are the previous version's (no update was applied):
    # published like a step without samples, so the version advances and the rollout side
    # goes on; a non-finite tensor never reaches the servers
    s.publish_weights(version=step)  # pause -> update -> continue on servers
    t_sync = time.time()
    if s.is_rank0:
        s.intake.record_trained(step, plan.sample_ids)
    merged = batches.merge_train_stats(train_stats, finalize_stats)
    skip_stats = s.skips.record(step, merged, mbs)  # collective: names the likely source
    stats = {**batch.stats, **merged, **critic_stats, **opd_stats, **moe_stats, **skip_stats}
    stats.update(
        {
            "version": step,
            "time/step": t_sync - t0,
            "time/wait_data": t_data - t0,
            "time/logprobs": t_fwd - t_data,
            "time/train": t_train - t_fwd,
            "time/weight_sync": t_sync - t_train,
            "prox/recomputed": float(recompute),
            "tokens/s": batch.stats.get("n_tokens_total", 0.0) / max(t_sync - t0, 1e-9),
            "mem/trainer_peak_rss_gib": peak_rss_gib(),
        }
    )
    return stats


def prox_forward_needed(cfg, step: int, n_updates: int) -> bool:
    """Whether RL step ``step`` runs a forward pass of its own for ``prox_logprobs``.

    π_prox is the policy of the weights before this step's update. When the actor takes
    ``n_updates`` ≤ 1 optimizer steps, its training forward runs on exactly those weights, so
    the loss can take π_prox from it (``make_policy_loss(prox_from_forward=True)``), as TRL
    does for its single-iteration GRPO. A separate forward stays needed with
    ``actor.prox_logprobs=recompute``, with several updates per step (the later minibatches
    train on moved weights), and where π_prox is read before training: on-policy
    distillation (the student's logprobs), ``kl_in_reward`` (GAE's KL penalty) and the
    routing-replay metrics' step (they compare π_prox with a free-routing forward)."""
    alg = cfg.algorithm
    read_before_training = (
        alg.opd != "off"
        or alg.kl_in_reward
        or (alg.routing_replay != "off" and free_routing_due(step, alg.routing_replay_free_every))
    )
    return cfg.actor.prox_logprobs == "recompute" or read_before_training or n_updates > 1


def peak_rss_gib() -> float:
    """The largest resident set any trainer rank has had so far (``VmHWM``), in GiB."""
    import torch
    import torch.distributed as dist

    peak = torch.tensor([float(proc_status_bytes("VmHWM") or 0) / 2**30])
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=False, help="recipe YAML")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. optimizer.lr=1e-6")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    check_against_model(cfg)
    s = TrainerSession(cfg)  # mesh, engines, resume, intake, logger
    try:
        if cfg.mode == "sft":
            from areal_mega.train.sft import run_sft

            run_sft(s)
            return
        evaluation.evaluate_before_training(s)
        for step in range(s.start_step + 1, cfg.total_steps + 1):
            stats = rl_step(s, step)
            stats.update(evaluation.evaluate_if_due(s, step))  # eval/*, at version `step`
            s.log(step, stats)
            s.skips.check()  # too many non-finite steps in a row: stop, naming the source
            s.maybe_checkpoint(step)
        s.finish()
    except (CheckpointSaveError, NonFiniteStepsError) as e:  # fatal: a relaunch repeats it
        print(f"[areal-mega] error: {e}", file=sys.stderr, flush=True)
        s.paths.write_fatal(str(e))
        sys.exit(FATAL_EXIT_CODE)  # ``finally`` still closes the session
    except Exception as e:  # died on a micro-batch: its samples are recorded (quarantine)
        record_crash(s.run_dir, s.mesh.rank, e)
        raise
    finally:
        s.close()


if __name__ == "__main__":
    main()

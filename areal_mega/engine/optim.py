"""The actor's megatron-core DDP wrapping, optimizer and LR schedule, from our config sections.

:class:`areal_mega.engine.MegatronEngine` builds its actor (and the critic) with these; so do
the checkpoint tests' trainers, so a saved optimizer state is the production one's."""

from __future__ import annotations

__all__ = ["wrap_ddp", "build_optimizer", "build_lr_scheduler"]


def wrap_ddp(config, chunks, pg_collection, use_distributed_optimizer: bool) -> list:
    """megatron's ``DistributedDataParallel`` around each model chunk (``config``: their
    TransformerConfig; ``pg_collection``: the mesh's process groups). Gradients are reduced in
    fp32 (``main_grad`` buffers) and summed, not averaged: the loss is already divided by the
    global denominator. Only the first chunk buckets its gradients (later VPP chunks: one
    bucket each)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
        average_in_collective=False,
    )
    return [
        DistributedDataParallel(
            config, ddp_cfg, c, disable_bucketing=(i > 0), pg_collection=pg_collection
        )
        for i, c in enumerate(chunks)
    ]


def build_optimizer(oc, config, model, use_distributed_optimizer: bool, pg_collection):
    """Adam over the trainable parameters of the DDP-wrapped ``model`` chunks (with LoRA: the
    adapters alone). ``oc``: :class:`areal_mega.config.OptimizerConfig`; ``config``: the
    model's TransformerConfig (dtypes)."""
    from megatron.core.optimizer import OptimizerConfig as MOptCfg
    from megatron.core.optimizer import get_megatron_optimizer

    cfg = MOptCfg(
        optimizer="adam",
        lr=oc.lr,
        min_lr=oc.min_lr,
        weight_decay=oc.weight_decay,
        adam_beta1=oc.beta1,
        adam_beta2=oc.beta2,
        adam_eps=oc.eps,
        clip_grad=oc.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
        # Without TE/apex megatron falls back to torch AdamW (decoupled weight decay).
    )
    return get_megatron_optimizer(
        cfg, model, use_gloo_process_groups=False, pg_collection=pg_collection
    )


def build_lr_scheduler(optimizer, oc, total_train_steps):
    """Warm-up then decay (``oc.lr_schedule``) over ``oc.lr_decay_steps`` or, when 0, the
    run's ``total_train_steps``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warm = oc.warmup_steps
    decay = oc.lr_decay_steps or total_train_steps or (warm + 1)
    decay = max(decay, warm + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warm else oc.lr,
        max_lr=oc.lr,
        min_lr=min(oc.min_lr, oc.lr),
        lr_warmup_steps=warm,
        lr_decay_steps=decay,
        lr_decay_style=oc.lr_schedule,
        start_wd=oc.weight_decay,
        end_wd=oc.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )

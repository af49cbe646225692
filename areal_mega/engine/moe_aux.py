"""Per-token scaling and logging of the MoE load-balancing (aux) loss.

The objective the engine optimises for an MoE model with ``router_aux_loss_coef`` = c is

    Σ_mb numerator_mb / D  +  c · Σ_mb aux_mb · T_mb / N

over the micro-batches of all DP ranks: ``D`` is the global loss denominator (the policy loss
is divided by it in the loss function), ``aux_mb = E · Σ_i f_i · P_i`` is the Switch-style
load-balancing loss of one micro-batch (per MoE layer, summed over layers), ``T_mb`` its
packed token count (every token is routed, padding included) and ``N = Σ_mb T_mb``. So the aux
term is the token-weighted mean of the per-micro-batch losses, independent of how the batch is
split into micro-batches or DP ranks.

megatron-core 0.19 with ``calculate_per_token_loss`` multiplies each rank's aux loss by its
local routed token count times the size of its TP×CP group
(``TopKRouter.attach_and_log_load_balancing_loss``; the router copies the flag when built, so
the engine's routers are set after the config is) and expects
``finalize_model_grads(num_tokens=...)`` to divide *every* gradient by the global token count
afterwards. The engine cannot let finalize do that: its policy-loss gradients are already
divided by ``D`` (which need not be a token count). Leaving megatron's multiplication alone
made the aux gradient ≈ c · T per micro-batch, thousands of times too strong. Instead, for
each training step this module sets the coefficient megatron reads
(``config.moe_aux_loss_coeff``) to ``c · G / (N · TP · CP)`` where ``G`` is the number of
ranks that share one micro-batch's tokens (CP, and TP under sequence parallelism): each rank's
contribution ``c·G/(N·TP·CP) · aux_partial · (T_mb/G) · TP·CP`` then sums over the ``G``
ranks to the objective above (without sequence parallelism the TP ranks hold copies of the
router's gradient, not parts of it, hence ``G`` counts only CP there). megatron-core 0.16
multiplied by the local token count alone; 0.19 added the TP×CP factor.
megatron's aux-loss tracker
logs ``aux / coefficient``, i.e. the unscaled loss, and :meth:`MoEAuxLoss.run` adds it to the
step's statistics as ``moe_aux_loss_sum`` / ``moe_aux_loss_tokens`` (the trainer's
``finalize_stats`` turns the pair into ``moe_aux_loss``: mean over MoE layers and
micro-batches, weighted by tokens across DP ranks and minibatches).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["MoEAuxLoss", "aux_coeff_for_step", "moe_aux_loss_scaling", "TRACKER_NAME"]

#: megatron's tracker key for the ``aux_loss`` load-balancing type.
TRACKER_NAME = "load_balancing_loss"


def aux_coeff_for_step(
    coeff: float, n_tokens_global: float, ranks_per_micro_batch: int, tp_cp_size: int = 1
) -> float:
    """The coefficient to hand megatron for one step so that the aux gradient is that of
    ``coeff · Σ_mb aux_mb · T_mb / n_tokens_global`` (see the module docstring):
    ``ranks_per_micro_batch`` ranks share a micro-batch's tokens, and megatron multiplies each
    rank's aux loss by ``tp_cp_size`` besides its local token count."""
    if n_tokens_global <= 0:
        return 0.0
    return float(coeff) * ranks_per_micro_batch / (float(n_tokens_global) * tp_cp_size)


class MoEAuxLoss:
    """Sets the per-step aux-loss coefficient around the engine's training schedule and reads
    megatron's aux-loss tracker after it. Built by :func:`moe_aux_loss_scaling`."""

    def __init__(self, config, mesh, n_moe_layers: int):
        self.config = config
        self.mesh = mesh
        self.coeff = float(config.moe_aux_loss_coeff)
        self.n_moe_layers = max(1, int(n_moe_layers))
        self.ranks_per_micro_batch = mesh.dims.cp * (
            mesh.dims.tp if config.sequence_parallel else 1
        )
        self.tp_cp_size = mesh.dims.tp * mesh.dims.cp

    def global_tokens(self, micro_batches: Sequence[dict]) -> float:
        """Σ over micro-batches and DP ranks of the packed token count."""
        local = sum(int(torch.as_tensor(mb["input_ids"]).numel()) for mb in micro_batches)
        t = torch.tensor([float(local)], dtype=torch.float64, device=self.mesh.device)
        if self.mesh.dims.dp > 1:
            dist.all_reduce(t, group=self.mesh.dp_group)
        return float(t.item())

    @contextlib.contextmanager
    def step_coefficient(self, micro_batches: Sequence[dict]):
        """Within the block ``config.moe_aux_loss_coeff`` is the per-step coefficient."""
        n = self.global_tokens(micro_batches)
        self.config.moe_aux_loss_coeff = aux_coeff_for_step(
            self.coeff, n, self.ranks_per_micro_batch, self.tp_cp_size
        )
        try:
            yield n
        finally:
            self.config.moe_aux_loss_coeff = self.coeff

    def _tracked_sum(self) -> float:
        """Σ over this DP rank's micro-batches and all MoE layers of the unscaled aux loss
        (partials summed over PP stages and over the ranks sharing the tokens)."""
        from megatron.core.transformer.moe import moe_utils

        entry = moe_utils.get_moe_layer_wise_logging_tracker().get(TRACKER_NAME)
        values = (
            entry["values"].detach().clone().float()
            if entry is not None
            else torch.zeros(self.config.num_layers, device=self.mesh.device)
        )
        values = values.to(self.mesh.device)
        if self.mesh.dims.pp > 1:
            dist.all_reduce(values, group=self.mesh.pp_group)
        tp_cp = getattr(self.mesh.pg_collection, "tp_cp", None)
        if tp_cp is not None and dist.get_world_size(tp_cp) > 1:
            dist.all_reduce(values, group=tp_cp)
        return float(values.sum())

    def run(
        self, run_schedule: Callable, micro_batches, step_fn, forward_only: bool, collect: bool
    ):
        """Run ``run_schedule`` (the engine's) with the per-step coefficient (training only)
        and add ``moe_aux_loss_sum`` / ``moe_aux_loss_tokens`` to the first record on the last
        stage, as shares that sum over the DP×CP ranks (``_reduce_stats``) to the totals."""
        if forward_only or not micro_batches:
            return run_schedule(micro_batches, step_fn, forward_only, collect)
        from megatron.core.transformer.moe import moe_utils

        moe_utils.clear_aux_losses_tracker()
        with self.step_coefficient(micro_batches):
            out = run_schedule(micro_batches, step_fn, forward_only, collect)
        mean = self._tracked_sum() / (self.n_moe_layers * len(micro_batches))
        moe_utils.clear_aux_losses_tracker()
        if self.mesh.is_last_stage and out:
            tokens = sum(int(torch.as_tensor(mb["input_ids"]).numel()) for mb in micro_batches)
            share = tokens / self.mesh.dims.cp
            out[0]["moe_aux_loss_sum"] = mean * share
            out[0]["moe_aux_loss_tokens"] = float(share)
        return out


def moe_aux_loss_scaling(engine) -> Optional[MoEAuxLoss]:
    """For an MoE actor with a nonzero aux-loss coefficient, the :class:`MoEAuxLoss` whose
    :meth:`MoEAuxLoss.run` the engine's ``forward_backward`` runs its schedule through (None
    when there is no aux loss)."""
    arch, config = engine.arch, engine.config
    if not arch.is_moe or not getattr(config, "moe_aux_loss_coeff", 0.0):
        return None
    if not config.calculate_per_token_loss:
        raise RuntimeError("MoE aux-loss scaling assumes config.calculate_per_token_loss")
    for chunk in engine.model:
        for mod in chunk.modules():
            # TopKRouter copies the flag when built, before the engine sets it on the config;
            # the scaling above assumes the routers multiply by their local token count
            if hasattr(mod, "attach_and_log_load_balancing_loss"):
                mod.calculate_per_token_loss = True
    return MoEAuxLoss(config, engine.mesh, sum(arch.moe_layer_pattern or ()))

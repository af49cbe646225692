"""megatron's ``TopKRouter`` with a family's own routing (the expert choice and weights
transformers computes, where megatron-core's routing functions differ): Ernie 4.5's
(:mod:`areal_mega.models.ernie4_5_moe`) and Gemma 4's (:mod:`areal_mega.models.gemma4`).

:class:`FamilyTopKRouter` keeps megatron's gate (fp32 with ``moe_router_dtype="fp32"``) and
z-loss, and hands the flattened logits to the subclass's :meth:`~FamilyTopKRouter.route`. It
refuses what its routing does not reproduce: megatron's load-balancing losses, token dropping
and router replay (the families' own refusals name why, e.g.
:func:`~areal_mega.engine.routing_replay.check_replay_target`)."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["FamilyTopKRouter"]


class FamilyTopKRouter(TopKRouter):
    """A ``TopKRouter`` whose :meth:`route` is the family's; ``family`` (the model type)
    names it in the refusal."""

    family = ""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        unsupported = {
            "moe_aux_loss_coeff": bool(config.moe_aux_loss_coeff),
            "moe_expert_capacity_factor": config.moe_expert_capacity_factor is not None,
            "moe_enable_routing_replay": config.moe_enable_routing_replay,
        }
        if any(unsupported.values()):
            raise ValueError(
                f"{self.family}'s router does not support "
                + ", ".join(k for k, v in unsupported.items() if v)
            )
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """``(probs, routing_map)`` of the gate's ``logits`` [seq, batch, experts]."""
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        return self.route(self.apply_z_loss(logits, padding_mask=padding_mask))

    def route(self, logits: torch.Tensor):
        """``(probs, routing_map)``, both [tokens, experts], of ``logits`` [tokens, experts]."""
        raise NotImplementedError

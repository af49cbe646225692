"""The megatron-core engine: actor, reference, critic and OPD teacher.

- :mod:`.megatron_engine` — :class:`MegatronEngine`: packed forward log-probabilities and the
  train step through megatron-core's pipeline schedule;
- :mod:`.micro_batch` — the model inputs of one packed micro-batch (THD parameters, the
  shared-prefix layout);
- :mod:`.packed` — pure helpers: the labels check, the block-diagonal causal mask, the zigzag
  context-parallel split;
- :mod:`.packed_params` — THD ``PackedSeqParams`` for TransformerEngine attention;
- :mod:`.loss_context` — the data side of the loss contract: what a loss function receives,
  and how numerators and statistics become the step's loss;
- :mod:`.loss_rows` — the output layer run on the rows the loss reads only;
- :mod:`.moe_aux` — per-token scaling and logging of the MoE load-balancing loss;
- :mod:`.dispatcher_graph` — the autograd graph megatron's MoE token dispatchers keep after
  a step, released (it kept every trained MoE engine alive);
- :mod:`.routing_replay` — rollout routing replay (R3) through megatron-core's
  ``RouterReplay``;
- :mod:`.optim` — the actor's optimizer and LR schedule, from our config sections;
- :mod:`.finite` — the non-finite check before an optimizer step, agreed by every rank, and
  the micro-batch's samples named in an error raised while it runs;
- :mod:`.critic` — :class:`CriticEngine`, the actor's model with a scalar value head.
"""

from areal_mega.engine.megatron_engine import MegatronEngine, default_denominator

__all__ = ["MegatronEngine", "default_denominator"]

"""Routed experts' biases left out of the sequence-parallel gradient sum (a megatron-core
0.19.2 defect, corrected on every device).

megatron's ``RowParallelLinear`` marks its bias ``sequence_parallel`` whenever the config has
sequence parallelism, a routed expert's ``linear_fc2.bias`` included. ``finalize_model_grads``
then sums every such gradient over the attention's TP group, as it must for a replicated
parameter that each TP rank saw a share of the tokens of. A routed expert's parameters are not
that: megatron marks them ``allreduce=False`` and DDP already sums their gradients over the
expert data-parallel group, whose ranks hold the same experts. megatron allows biased experts
only at expert TP 1, so with TP > 1 the TP ranks either hold the same experts (expert DP, already
summed: the TP sum doubles the gradient) or different ones (expert parallel: the TP sum adds
another expert's gradient). Either way the sum is wrong; :func:`unmark_expert_biases` takes the
mark off. ``tests/test_expert_bias.py`` fails once megatron-core stops marking them.
"""

from __future__ import annotations

import torch

__all__ = ["unmark_expert_biases"]


def unmark_expert_biases(module: torch.nn.Module) -> int:
    """Clear ``sequence_parallel`` on ``module``'s routed-expert parameters (``allreduce`` False)
    so that ``finalize_model_grads`` does not sum their gradients over TP. Returns how many."""
    n = 0
    for p in module.parameters():
        if not getattr(p, "allreduce", True) and getattr(p, "sequence_parallel", False):
            p.sequence_parallel = False
            n += 1
    return n

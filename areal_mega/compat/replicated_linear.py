"""A torch stand-in for TransformerEngine's replicated linear (``TELinear`` with
``parallel_mode="duplicated"``), which megatron-core's DeepSeek sparse attention asks its spec
backend for; the patch ``absorbed_mla_local_linear`` (:mod:`.megatron_cpu`) makes the absorbed
MLA accept it."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ReplicatedLinear"]


class ReplicatedLinear(torch.nn.Module):
    """A bias-free linear layer replicated across tensor parallelism, in place of
    TransformerEngine's ``TELinear`` with ``parallel_mode="duplicated"``: the latent down
    projections of DSA's absorbed MLA and the indexer's projections
    (areal_mega/models/dsa.py). ``forward`` returns ``(output, None)``
    like megatron's linears. Under sequence parallelism each rank sees its own tokens, so the
    weight is marked ``sequence_parallel`` (its gradient summed over TP)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        gather_output: bool = False,
        parallel_mode: Optional[str] = None,
        **_unused,
    ):
        super().__init__()
        if bias or skip_weight_param_allocation or gather_output:
            raise ValueError(
                "ReplicatedLinear: a bias-free weight of its own, output not gathered (got "
                f"bias={bias}, skip_weight_param_allocation={skip_weight_param_allocation}, "
                f"gather_output={gather_output})"
            )
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"ReplicatedLinear: parallel_mode={parallel_mode!r}")
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            init_method(self.weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor):
        """``(x @ W^T, None)``."""
        return torch.nn.functional.linear(x, self.weight), None

"""Distributed-optimizer state in *model space*: our own reshardable format.

megatron-core 0.16.1's own distributed-optimizer checkpoint formats fail on CPU-only torch
(``fully_sharded_model_space``: "ShardedTensor.flattened_range is not supported";
``dp_reshardable``: an assertion on the per-parameter ``step``; ``fully_reshardable``: ``.cuda()``
in the DP gather). This module saves what those formats save, by other means: for every model
parameter, its fp32 main weight and Adam moments are re-assembled from the DP shards (one
all-reduce per parameter over the optimizer's data-parallel group: each rank fills the flat
range it owns, zeros elsewhere) and stored as sharded tensors with the *parameter's own*
sharding (key ``optimizer.distopt.<state>.<param key>``), so they reshard over TP/PP/EP exactly
like the weights. Loading slices each rank's flat range back out.

Cost: the save materialises the full (TP-local) optimizer state on every DP rank, on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "chain_members",
    "distributed_optimizers",
    "distopt_sharded_state",
    "distopt_load_state",
    "entries_by_param",
    "model_parameters",
    "optimizer_tensor",
    "params_in_order",
    "sharded_entry",
    "FORMAT",
    "STATES",
]

FORMAT = "areal-distopt-model-space/1"
#: what the format keeps per parameter: the fp32 main weight and Adam's two moments
STATES = ("param", "exp_avg", "exp_avg_sq")


def chain_members(optimizer) -> List:
    """The optimizers of megatron's chain ``optimizer`` (``[optimizer]`` when not chained)."""
    from megatron.core.optimizer import ChainedOptimizer

    return optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def distributed_optimizers(optimizer) -> List:
    """The megatron ``DistributedOptimizer``s inside ``optimizer`` (chained or not)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in chain_members(optimizer) if isinstance(o, DistributedOptimizer)]


def optimizer_tensor(entry, key: str, data: torch.Tensor):
    """The parameter's sharded ``entry`` (a sharded tensor or factory) under ``key``, holding
    optimizer state ``data`` (fp32): a plain sharded tensor takes the data's dtype, else a
    bf16 parameter's entry fails megatron's metadata check (megatron's
    ``make_sharded_optimizer_tensor`` does the same)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(entry, ShardedTensor):
        return dataclasses.replace(entry, key=key, data=data, dtype=data.dtype)
    return dataclasses.replace(entry, key=key, data=data)


def entries_by_param(model_sds: Sequence[dict]) -> Dict[int, object]:
    """Each parameter's sharded entry (tensor or factory) in the chunks' sharded state dicts
    ``model_sds``, by the parameter's (data pointer, shape) (:func:`sharded_entry`)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for sd in model_sds:
        for e in nested_values(sd):
            if isinstance(e, (ShardedTensor, ShardedTensorFactory)) and e.data is not None:
                out[(e.data.data_ptr(), tuple(e.data.shape))] = e
    return out


def sharded_entry(by_param: dict, p: torch.Tensor):
    """Parameter ``p``'s entry in :func:`entries_by_param`'s map."""
    entry = by_param.get((p.data_ptr(), tuple(p.shape)))
    if entry is None:
        raise RuntimeError(
            f"optimizer parameter {tuple(p.shape)} has no sharded entry in the model state dict"
        )
    return entry


def model_parameters(model):
    """The parameters of the model chunks ``model`` (wrapped or not), in model order."""
    for chunk in model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        yield from chunk.parameters()


def params_in_order(model, opt):
    """Every parameter this optimizer owns (whether or not this DP rank holds a piece of it),
    in model order: the same sequence on every rank of the optimizer's DP group."""
    owned = set()
    for buf in opt.buffers:
        owned.update(buf.param_index_map.keys())
    return [p for p in model_parameters(model) if p in owned]


def distopt_sharded_state(optimizer, model, model_sds: Sequence[dict], *, is_loading: bool) -> dict:
    """The sharded state dict of ``optimizer``'s distributed optimizers (collective over each
    optimizer's data-parallel group). ``model_sds``: the chunks' ``sharded_state_dict()``."""
    by_param = entries_by_param(model_sds)
    out: dict = {}
    for i, o in enumerate(distributed_optimizers(optimizer)):
        group = o.data_parallel_group
        states: dict = {k: {} for k in STATES}
        step = torch.zeros((), dtype=torch.float64)
        for j, p in enumerate(params_in_order(model, o)):
            entry = sharded_entry(by_param, p)
            full = torch.zeros((len(STATES), p.numel()), dtype=torch.float32)
            if not is_loading and p in o.model_param_group_index_map:  # has a local piece
                r = o._get_model_param_range_map(p)["param"]
                t = o._get_main_param_and_optimizer_states(p)
                for k, name in enumerate(STATES):
                    if name in t:
                        full[k, r.start : r.end] = t[name].detach().reshape(-1).float()
                if "step" in t:
                    step = torch.maximum(step, t["step"].detach().double().reshape(()))
            if not is_loading and dist.get_world_size(group) > 1:
                dist.all_reduce(full, group=group)
            for k, name in enumerate(STATES):
                states[name][str(j)] = optimizer_tensor(
                    entry, f"optimizer.distopt.{name}.{entry.key}", full[k].view(p.shape)
                )
        if not is_loading:
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
        out[str(i)] = {"states": states, "step": float(step)}
    return out


def distopt_load_state(optimizer, model, loaded: dict) -> None:
    """Put loaded model-space state (from :func:`distopt_sharded_state` with
    ``is_loading=True``, after ``dist_checkpointing.load``) into each rank's shards.

    The moments and main weights are keyed by parameter, so they reshard over any layout; the
    Adam step is kept per optimizer of the chain, whose split depends on the layout (megatron
    gives the experts an optimizer of their own only when their data-parallel group differs
    from the dense parameters', e.g. at another expert TP). The chain's optimizers step
    together, so an optimizer the saving layout did not have takes the chain's step."""
    saved = [v["step"] for v in loaded.values() if "step" in v]
    if not saved:
        raise ValueError(
            "the distributed-optimizer state holds no Adam step (a corrupt checkpoint)"
        )
    for i, o in enumerate(distributed_optimizers(optimizer)):
        o._init_optimizer_states_with_dummy_values()
        states = loaded[str(i)]["states"]
        step = torch.tensor(float(loaded[str(i)].get("step", max(saved))))
        for j, p in enumerate(params_in_order(model, o)):
            if p not in o.model_param_group_index_map:
                continue
            r = o._get_model_param_range_map(p)["param"]
            cur = o._get_main_param_and_optimizer_states(p)
            new = {}
            for name, dst in cur.items():
                if name == "step":
                    new[name] = step.to(dst.dtype).reshape(dst.shape)
                else:
                    src = states[name][str(j)].reshape(-1)[r.start : r.end]
                    new[name] = src.to(dst.dtype).view(dst.shape)
            with torch.no_grad():  # fp32 main params are views of the (leaf) model params
                o._set_main_param_and_optimizer_states(p, new)

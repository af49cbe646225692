"""A checkpoint's optimizer state loaded into the other kind of optimizer: a run resumed with
``optimizer.use_distributed_optimizer`` switched.

Both formats hold, for every trainable parameter, its fp32 main weight and Adam moments as
sharded tensors with the *parameter's own* sharding, keyed by the parameter's checkpoint key:

* megatron's regular optimizers (``optimizer.sharded_state_dict``): ``optimizer.state.
  {exp_avg,exp_avg_sq}.<key>``, the main weight as ``optimizer.state.fp32_param.<key>`` for a
  bf16/fp16 parameter (an fp32 parameter is its own main weight: the model's tensor), and one
  Adam step per optimizer of the chain (``common_step``);
* ours for the distributed optimizer (:mod:`areal_mega.checkpoint.distopt_state`):
  ``optimizer.distopt.{param,exp_avg,exp_avg_sq}.<key>`` and a step per optimizer.

So either loads into the other by key, over any layout: the loading side asks for the saved
kind's keys with its own parameters' sharding, and puts the full (TP/EP-local) tensors into its
state (the distributed optimizer: each rank's flat range). The chain's optimizers step
together: the step is the largest saved one."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from areal_mega.checkpoint.distopt_state import (
    STATES,
    chain_members,
    distopt_load_state,
    distributed_optimizers,
    entries_by_param,
    model_parameters,
    optimizer_tensor,
    params_in_order,
    sharded_entry,
)

__all__ = [
    "regular_state_for_distributed",
    "load_regular_into_distributed",
    "distributed_state_for_regular",
    "load_distributed_into_regular",
]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _steps(tree, name: str) -> List[float]:
    """Every value under a key ``name`` in the nested dicts / lists ``tree``."""
    out = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == name and not isinstance(v, (dict, list)):
                out.append(float(v))
            else:
                out += _steps(v, name)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            out += _steps(v, name)
    return out


# ---------------------------------------------------------------- regular -> distributed


def regular_state_for_distributed(optimizer, model, model_sds: Sequence[dict]) -> dict:
    """What to load from a regular optimizer's checkpoint for ``optimizer``'s distributed
    optimizers: per optimizer of the chain and parameter (model order), its moments and, for a
    parameter that is not fp32, its saved main weight (:func:`load_regular_into_distributed`
    takes the result of ``dist_checkpointing.load``)."""
    by_param = entries_by_param(model_sds)
    out: dict = {}
    for i, o in enumerate(distributed_optimizers(optimizer)):
        names = {k: {} for k in ("fp32_param",) + _MOMENTS}
        for j, p in enumerate(params_in_order(model, o)):
            entry = sharded_entry(by_param, p)
            wanted = _MOMENTS if p.dtype == torch.float32 else ("fp32_param",) + _MOMENTS
            for name in wanted:
                full = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                names[name][str(j)] = optimizer_tensor(
                    entry, f"optimizer.state.{name}.{entry.key}", full
                )
        out[str(i)] = names
    return out


def load_regular_into_distributed(optimizer, model, requested: dict, saved_common) -> None:
    """Put a regular optimizer's loaded state (``requested``: the loaded result of
    :func:`regular_state_for_distributed`; ``saved_common``: the checkpoint's common optimizer
    state, holding megatron's ``common_step``) into each rank's shards of ``optimizer``'s
    distributed optimizers. An fp32 parameter's main weight is the model's (loaded before)."""
    steps = _steps(saved_common, "common_step")
    if not steps:
        raise ValueError("the regular optimizer's state holds no Adam step (common_step)")
    converted = {}
    for i, o in enumerate(distributed_optimizers(optimizer)):
        got = requested[str(i)]
        states: Dict[str, dict] = {name: {} for name in STATES}
        for j, p in enumerate(params_in_order(model, o)):
            main = got.get("fp32_param", {}).get(str(j))  # none for an fp32 parameter
            states["param"][str(j)] = p.detach().float() if main is None else main
            for name in _MOMENTS:
                states[name][str(j)] = got[name][str(j)]
        converted[str(i)] = {"states": states, "step": max(steps)}
    distopt_load_state(optimizer, model, converted)


# ---------------------------------------------------------------- distributed -> regular


def _trainable_in_order(model, optimizer) -> list:
    """``(model parameter, its main parameter, the chain's optimizer that steps it)`` for every
    parameter ``optimizer`` (regular, chained or not) trains, in model order."""
    owner = {}
    for o in chain_members(optimizer):
        for group in o.optimizer.param_groups:
            for q in group["params"]:
                owner[q] = o
    out = []
    for p in model_parameters(model):
        main = getattr(p, "main_param", None)
        main = main if main is not None and main in owner else p
        if main in owner:
            out.append((p, main, owner[main]))
    return out


def distributed_state_for_regular(optimizer, model, model_sds: Sequence[dict]) -> dict:
    """What to load from a distributed optimizer's checkpoint (our format) for the regular
    ``optimizer``: each trained parameter's main weight and moments, by the parameter's key
    (:func:`load_distributed_into_regular` takes the loaded result)."""
    by_param = entries_by_param(model_sds)
    out: dict = {}
    for j, (p, _, _) in enumerate(_trainable_in_order(model, optimizer)):
        entry = sharded_entry(by_param, p)
        out[str(j)] = {
            name: optimizer_tensor(
                entry,
                f"optimizer.distopt.{name}.{entry.key}",
                torch.zeros(p.shape, dtype=torch.float32, device=p.device),
            )
            for name in STATES
        }
    return out


def load_distributed_into_regular(optimizer, model, requested: dict, saved_common) -> None:
    """Put a distributed optimizer's loaded state (``requested``: the loaded result of
    :func:`distributed_state_for_regular`; ``saved_common``: the checkpoint's common optimizer
    state, holding each saved optimizer's ``step``) into the regular ``optimizer``: main
    weights, Adam moments and the step of every optimizer of the chain."""
    steps = _steps(saved_common, "step")
    if not steps:
        raise ValueError("the distributed optimizer's state holds no Adam step")
    step = max(steps)
    for o in chain_members(optimizer):
        o.init_state_fn(o.optimizer, o.config)
    with torch.no_grad():
        for j, (p, main, o) in enumerate(_trainable_in_order(model, optimizer)):
            got = requested[str(j)]
            main.copy_(got["param"].view(main.shape).to(main.dtype))
            if main is not p:  # a bf16/fp16 parameter: the model holds the main weight rounded
                p.copy_(main.to(p.dtype))
            state = o.optimizer.state[main]
            for name in _MOMENTS:
                state[name].copy_(got[name].view(main.shape).to(state[name].dtype))
            state["step"] = torch.tensor(step, dtype=torch.float32)

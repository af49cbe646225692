"""Rollout routing replay (R3) for the actor: megatron-core's own ``RouterReplay`` driven with
the experts the inference server chose.

With ``moe_enable_routing_replay`` every ``TopKRouter`` owns a ``RouterReplay`` (megatron-core
0.16.1, ``transformer/moe/router_replay.py``); its top-k is then, per action:

* ``REPLAY_FORWARD``: the target indices set with ``set_target_indices``; the gating weights
  are gathered from the trainer's own router scores at those indices (``scores.gather``) and,
  for the softmax router without pre-softmax (Qwen3-MoE, ``norm_topk_prob``), renormalised by
  a softmax over the k gathered logits, so the router still receives gradients;
* ``REPLAY_BACKWARD``: the oldest entry of a FIFO that every ``set_target_indices`` appends
  to, for the forward that activation recompute re-runs during backward;
* ``RECORD``: the router's free top-k, kept as ``recorded_topk_idx``;
* none: free routing.

How this module drives it (:class:`RouteReplayer`, one per actor engine):

* The instances are taken from the engine's own model chunks (each ``TopKRouter``'s
  ``router_replay``), never from the class-wide ``global_router_replay_instances`` list, which
  also holds the routers of any other replaying model built in the process. So each pipeline
  stage (and each virtual chunk) drives exactly its own layers, the column of the packed
  routes being the router's MoE-layer index (global ``layer_number`` through the MoE layer
  pattern), and a reference model or critic (built without replay) has no instances at all.
* Per micro-batch and model chunk, right before the chunk's forward: targets = the packed
  routes of the tokens this rank's router sees — the CP rank's zigzag share of the packed
  sequence, then, with sequence parallelism, the TP rank's contiguous ``1/TP`` slice of it
  (the router runs on the sequence-parallel shard, before the expert dispatch; EP does not
  change which tokens a router sees) — and action ``REPLAY_FORWARD``.
* A gradient hook on the chunk's output switches that chunk's routers to ``REPLAY_BACKWARD``
  when the micro-batch's backward starts, so a recomputed forward pops its own micro-batch's
  targets (the FIFO order is the schedule's backward order, also under 1F1B); the next
  forward switches back.
* After every schedule run the targets, the FIFOs and the actions are cleared.

Rows of -1 (tokens the server never forwarded: at least each sequence's last token; and the
packing's padding) cannot be replayed as given (megatron takes indices for every token, no
mask), and megatron-core offers no clean way to mix in the router's own top-k for some rows
(the targets are fixed before the forward). They get valid distinct experts
(:func:`fill_missing_routes`), chosen on the whole packed micro-batch so that every layout
replays the same ones. Their outputs never reach the policy loss (a last token has no label;
padding is its own segment, and causal attention never lets another token see them); they do
reach the MoE aux loss, which counts every packed token (padding included, as without replay)
and routes by the router's free top-k, through those tokens' hidden states in later layers.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import torch

from areal_mega.common.moe_routes import repeated_expert

__all__ = [
    "ROUTES_KEY",
    "RouteReplayer",
    "check_replay_target",
    "check_routes",
    "cleared_after",
    "fill_missing_routes",
    "free_routing_if",
    "moe_layer_columns",
    "route_agreement_counts",
    "sequence_parallel_slice",
]

#: The packed micro-batch field (and trajectory ``token_extras`` name) holding the routes.
ROUTES_KEY = "routed_experts"


def moe_layer_columns(pattern: Sequence[int]) -> dict:
    """Global 1-based layer number -> index among the MoE layers (the routes' layer axis),
    for a per-layer pattern (1 = MoE, 0 = dense)."""
    out, col = {}, 0
    for i, is_moe in enumerate(pattern):
        if is_moe:
            out[i + 1] = col
            col += 1
    return out


def fill_missing_routes(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``routes`` [T, layers, topk] with every row holding a -1 replaced by distinct valid
    experts ``(t·topk + j) mod num_experts`` (spread over the experts, distinct as topk <=
    num_experts); other rows unchanged. Returns int64."""
    routes = routes.long()
    t, layers, k = routes.shape
    missing = (routes < 0).any(dim=-1, keepdim=True)
    filler = (torch.arange(t)[:, None] * k + torch.arange(k)[None, :]) % num_experts
    filler = filler[:, None, :].expand(t, layers, k)
    return torch.where(missing, filler, routes)


def sequence_parallel_slice(n_tokens: int, tp: int, tp_rank: int) -> slice:
    """The tokens a TP rank's router sees under sequence parallelism: its contiguous share of
    the (CP-local) sequence, as megatron's scatter to the sequence-parallel region cuts it."""
    if n_tokens % tp:
        raise ValueError(f"{n_tokens} tokens are not divisible by TP={tp} (sequence parallel)")
    per = n_tokens // tp
    return slice(tp_rank * per, (tp_rank + 1) * per)


def check_routes(
    routes: torch.Tensor, total: int, n_layers: int, topk: int, num_experts: int
) -> None:
    """Raise a ValueError naming the field when packed ``routes`` are not
    ``[total, n_layers, topk]`` expert ids in ``[-1, num_experts)``, distinct within a token's
    top-k."""
    want = (total, n_layers, topk)
    where = f"micro-batch field {ROUTES_KEY!r} (token_extras.{ROUTES_KEY})"
    if tuple(routes.shape) != want:
        raise ValueError(
            f"{where} has shape {tuple(routes.shape)}, expected {want} (packed "
            "tokens, MoE layers, top-k)"
        )
    if routes.numel() and (int(routes.min()) < -1 or int(routes.max()) >= num_experts):
        raise ValueError(
            f"{where} holds expert ids in [{int(routes.min())}, "
            f"{int(routes.max())}], expected [-1, {num_experts})"
        )
    rep = repeated_expert(routes.cpu().numpy()) if topk > 1 else None
    if rep is not None:
        raise ValueError(
            f"{where}: token {rep[0]}, MoE layer {rep[1]} names expert {rep[2]} twice in its top-k"
        )


def route_agreement_counts(free: torch.Tensor, rollout: torch.Tensor) -> tuple[int, int]:
    """(agreeing rows, compared rows) between the trainer's free top-k ``free`` [N, topk] and
    the rollout's ``rollout`` [N, topk], as sets; rows with a -1 in ``rollout`` are skipped."""
    known = (rollout >= 0).all(dim=-1)
    same = (free.long().sort(dim=-1).values == rollout.long().sort(dim=-1).values).all(dim=-1)
    return int((same & known).sum()), int(known.sum())


def check_replay_target(routing_replay: bool, role: str, arch) -> None:
    """Raise a ValueError naming ``algorithm.routing_replay`` when replay is asked for a
    dense model or for a model other than the actor (reference models never replay)."""
    if not routing_replay:
        return
    if role != "actor":
        raise ValueError(f"routing replay is for the actor only, not role={role!r}")
    if not arch.is_moe:
        raise ValueError(
            f"algorithm.routing_replay='r3' needs a mixture-of-experts model; "
            f"model_type {arch.model_type!r} is dense (set "
            "algorithm.routing_replay=off)"
        )
    if arch.model_type == "gemma4_text":
        raise ValueError(
            "algorithm.routing_replay='r3' is not supported for model_type 'gemma4_text': its "
            "router (a normalised, scaled input; per-expert weight scales) is its own module, "
            "which neither megatron's route replay nor the rollout servers' route capture "
            "covers (set algorithm.routing_replay=off)"
        )
    if arch.moe_score_function != "softmax" or arch.moe_expert_bias:
        # megatron would replay these routers' indices correctly, but no rollout server
        # reports them yet: the CPU server's capture recomputes a softmax top-k
        raise ValueError(
            f"algorithm.routing_replay='r3' is not supported for model_type "
            f"{arch.model_type!r}: the rollout servers' route capture covers the "
            "softmax top-k router only, not a router with an expert bias (the sigmoid "
            "routers, Ernie 4.5's softmax router) (set algorithm.routing_replay=off)"
        )


@contextmanager
def cleared_after(replayer: Optional["RouteReplayer"]):
    """Clear ``replayer``'s routers (if any) when the block ends, however it ends."""
    try:
        yield
    finally:
        if replayer is not None:
            replayer.clear()


@contextmanager
def free_routing_if(replayer: Optional["RouteReplayer"], free: bool):
    """Within the block ``replayer`` records free routing instead of replaying (``free``)."""
    if free and replayer is None:
        raise ValueError("free_routing needs an engine built with routing_replay=True")
    if replayer is None:
        yield
        return
    replayer.free = free
    try:
        yield
    finally:
        replayer.free = False


class RouteReplayer:
    """Drives the ``RouterReplay`` instances of one engine's model chunks (see the module
    docstring). ``model``: the engine's chunks (DDP-wrapped or bare); ``mesh``: its
    ParallelMesh; ``arch``: its :class:`~areal_mega.models.builder.HFArch`."""

    def __init__(self, model: Sequence, mesh, arch):
        from megatron.core.transformer.moe.router import TopKRouter

        self.mesh = mesh
        self.num_experts = arch.num_experts
        self.topk = arch.moe_topk
        pattern = list(arch.moe_layer_pattern or [1] * arch.num_layers)
        self.n_moe_layers = int(sum(pattern))
        columns = moe_layer_columns(pattern)
        self.chunks: list[list] = []  # per chunk: [(RouterReplay, MoE column)]
        for chunk in model:
            routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
            if any(r.router_replay is None for r in routers):
                raise RuntimeError(
                    "routing replay needs a model built with moe_enable_routing_replay=True"
                )
            self.chunks.append([(r.router_replay, columns[r.layer_number]) for r in routers])
        self.free = False  # RECORD (free routing) instead of replay
        self.agree = torch.zeros(2, dtype=torch.long)  # (agreeing, compared) rows x layers

    @property
    def instances(self) -> list:
        """This engine's RouterReplay instances, chunk by chunk, in layer order."""
        return [rr for chunk in self.chunks for rr, _ in chunk]

    def local_routes(self, mb, index: Optional[torch.Tensor]) -> dict:
        """This rank's routes of a packed micro-batch: ``{"targets": filled int64, "given":
        as sent (-1 kept)}``, both [T_router, layers, topk] for the tokens its routers see
        (CP share ``index``, then the sequence-parallel slice)."""
        if ROUTES_KEY not in mb or mb[ROUTES_KEY] is None:
            raise ValueError(
                f"routing replay is on but the micro-batch has no {ROUTES_KEY!r} "
                f"(token_extras.{ROUTES_KEY} of its trajectories)"
            )
        total = int(torch.as_tensor(mb["input_ids"]).numel())
        given = torch.as_tensor(mb[ROUTES_KEY]).long()
        check_routes(given, total, self.n_moe_layers, self.topk, self.num_experts)
        # filled on the whole micro-batch, so that every layout replays the same stand-ins
        routes = {"given": given, "targets": fill_missing_routes(given, self.num_experts)}
        for key, value in routes.items():
            if index is not None:
                value = value.index_select(0, index)
            if self.mesh.sequence_parallel and self.mesh.dims.tp > 1:
                value = value[
                    sequence_parallel_slice(value.shape[0], self.mesh.dims.tp, self.mesh.tp_rank)
                ]
            routes[key] = value
        return routes

    def arm(self, chunk_index: int, routes: dict):
        """Arm chunk ``chunk_index``'s routers for one micro-batch's forward: replay its
        targets (``REPLAY_FORWARD``), or record the free top-k in free mode. Returns the
        function to call with the chunk's output: it counts the agreement (free mode) or, when
        the output takes part in autograd, hooks the switch to ``REPLAY_BACKWARD`` for when
        this micro-batch's backward reaches it (recompute then pops its own targets)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as Action

        chunk, dev = self.chunks[chunk_index], self.mesh.device
        for rr, col in chunk:
            if self.free:
                rr.set_router_replay_action(Action.RECORD)
            else:
                rr.set_target_indices(routes["targets"][:, col, :].to(dev))
                rr.set_router_replay_action(Action.REPLAY_FORWARD)

        def to_backward(grad):
            for rr, _ in chunk:
                rr.set_router_replay_action(Action.REPLAY_BACKWARD)
            return grad

        def done(output: torch.Tensor) -> None:
            if self.free:
                for rr, col in chunk:
                    a, n = route_agreement_counts(
                        rr.get_recorded_indices().cpu(), routes["given"][:, col, :]
                    )
                    self.agree += torch.tensor([a, n])
            elif output.requires_grad:
                output.register_hook(to_backward)

        return done

    def clear(self) -> None:
        """Drop every target, FIFO entry, recording and action of this engine's routers."""
        for rr in self.instances:
            rr.clear_indices()
            rr.clear_router_replay_action()

    def reset_agreement(self) -> None:
        """Zero the free-routing agreement counters."""
        self.agree.zero_()

    def agreement(self) -> tuple[float, float]:
        """(agreeing, compared) token x layer rows of the free forwards since the last reset,
        summed over every rank (each rank counts its own tokens and layers; TP ranks without
        sequence parallelism see the same tokens and only TP rank 0 counts)."""
        import torch.distributed as dist

        vec = self.agree.clone().double()
        m = self.mesh
        if m.dims.tp > 1 and not m.sequence_parallel and m.tp_rank != 0:
            vec.zero_()
        vec = vec.to(m.device)
        for size, group in (
            (m.dims.tp, m.tp_group),
            (m.dims.pp, m.pp_group),
            (m.dims.dp * m.dims.cp, m.dp_cp_group),
        ):
            if size > 1:
                dist.all_reduce(vec, group=group)
        return float(vec[0]), float(vec[1])

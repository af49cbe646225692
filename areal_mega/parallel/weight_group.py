"""The weight-update group of ``rollout.weight_update=distributed`` against the parallel layout
(pure: plain data in and out, no torch).

The trainer's sender is rank 0 of a broadcast group shared with every rollout server; server
``i`` joins as ranks ``rank_offsets[i] .. rank_offsets[i] + ranks_per_server - 1`` (SGLang and
vLLM: ``rank_offset + tp_rank``). The launcher (:mod:`areal_mega.launch.local`), the trainer
(:mod:`areal_mega.train.session`) and the sender (:mod:`areal_mega.train.weight_sender`) all
take the group from here, so their world sizes and rank offsets agree (a mismatch hangs the
broadcast).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_mega.common.errors import ConfigError
from areal_mega.parallel.allocation import Allocation


@dataclass(frozen=True)
class WeightGroup:
    """The broadcast group of ``rollout.weight_update=distributed``: the trainer's sender is
    rank 0, server ``i`` joins as ranks ``rank_offsets[i] .. rank_offsets[i] + ranks_per_server
    - 1`` (SGLang: ``rank_offset + tp_rank``)."""
    world_size: int
    rank_offsets: tuple
    ranks_per_server: int

    @classmethod
    def of(cls, n_servers: int, ranks_per_server: int = 1) -> "WeightGroup":
        """The group of rank 0 and ``n_servers`` servers of ``ranks_per_server`` ranks each,
        server ``i`` from rank ``1 + i·ranks_per_server``."""
        per = int(ranks_per_server)
        return cls(1 + n_servers * per, tuple(1 + i * per for i in range(n_servers)), per)

    def resized(self, n_servers: int) -> "WeightGroup":
        """The same group shape (ranks per server) for ``n_servers`` servers: the group formed
        again after servers joined or left (elastic rollout)."""
        return WeightGroup.of(n_servers, self.ranks_per_server)


#: backends whose server runs one weight-group rank per tensor-parallel rank (it joins as
#: ``rank_offset + tp_rank``); a ``local`` server is one rank
MULTI_RANK_BACKENDS = ("sglang", "vllm")
_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}


def weight_update_group(alloc: Optional[Allocation], backend: str,
                        n_servers: Optional[int] = None) -> WeightGroup:
    """World size and per-server rank offsets of the weight-update group (pure).

    The allocation string is the only authority: an SGLang or vLLM server of ``sglang:dDtT``
    / ``vllm:dDtT`` runs ``T`` ranks (its tensor-parallel size), a ``local`` server one.
    ``n_servers`` (the servers the sender talks to, e.g. ``len(rollout.server_addrs)``)
    defaults to ``d`` and must equal it when the allocation has a rollout part. ``alloc`` may
    be None (or trainer-only) only for the ``local`` backend, whose servers are one rank each.
    Raises :class:`ConfigError`."""
    rollout = alloc.rollout if alloc is not None else None
    if backend not in ("local", *MULTI_RANK_BACKENDS):
        raise ConfigError(f"rollout.backend={backend!r}: must be 'local', 'sglang' or 'vllm'")
    if rollout is not None and alloc.rollout_backend != backend:
        raise ConfigError(f"rollout.backend={backend!r} but allocation={alloc.canonical()!r} "
                          f"names {alloc.rollout_backend!r} servers; make them agree")
    if rollout is None:
        if backend in MULTI_RANK_BACKENDS:
            where = f"allocation={alloc.canonical()!r}" if alloc else "allocation"
            raise ConfigError(f"{where} has no rollout part, so the {_NAMES[backend]} servers' "
                              "tensor parallel size is unknown; write it there, e.g. "
                              f"'{backend}:d2t4+megatron:...' (with rollout.server_addrs set, "
                              "no servers are launched)")
        if n_servers is None:
            raise ConfigError("weight_update_group: n_servers is needed without a rollout "
                              "part in the allocation")
        per = 1
    else:
        if n_servers is not None and n_servers != rollout.dp:
            raise ConfigError(f"rollout.server_addrs: {n_servers} server(s) but allocation="
                              f"{alloc.canonical()!r} has d{rollout.dp}; make them agree")
        if backend in MULTI_RANK_BACKENDS and rollout.pp > 1:
            raise ConfigError(f"allocation={alloc.canonical()!r}: {_NAMES[backend]} joins the "
                              "weight group as rank_offset + tp_rank, so servers with p>1 "
                              "would collide; use rollout.weight_update=disk")
        per = rollout.tp if backend in MULTI_RANK_BACKENDS else 1
        n_servers = rollout.dp
    if n_servers < 1:
        raise ConfigError(f"rollout.server_addrs: {n_servers} servers; the weight group "
                          "needs at least one")
    return WeightGroup.of(n_servers, per)

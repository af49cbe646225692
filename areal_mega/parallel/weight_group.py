"""The weight-update group of ``rollout.weight_update=distributed``: its shape against the
parallel layout, and the torch process group that forms it.

The trainer's sender is rank 0 of a broadcast group shared with every rollout server; server
``i`` joins as ranks ``rank_offsets[i] .. rank_offsets[i] + ranks_per_server - 1`` (SGLang and
vLLM: ``rank_offset + tp_rank``). The launcher (:mod:`areal_mega.launch.local`), the trainer
(:mod:`areal_mega.train.session`) and the sender (:mod:`areal_mega.train.weight_sender`) all
take the group from :func:`weight_update_group` (pure: plain data in and out), so their world
sizes and rank offsets agree (a mismatch hangs the broadcast).

The process group (:func:`init_update_group`, :func:`broadcast_from_rank0`,
:func:`destroy_update_group`; torch imported inside them, so the launcher loads none) is
created the way SGLang creates it. SGLang's ``init_weights_update_group`` (and AReaL's
trainer, which copies it) builds the group with torch's ``_new_process_group_helper`` on a
``tcp://`` rendezvous store wrapped in ``PrefixStore(group_name)``. The helper adds its own
``"{group_name}/"`` and per-device
(``"cpu/"``, ``"cuda/"``) prefixes and, for gloo, connects one context per device, so a group
built any other way (e.g. ``ProcessGroupGloo(PrefixStore(group_name, store), ...)``) never meets
an SGLang peer: both sides wait for keys the other never writes. The trainer's sender (rank 0)
and the CPU server (ranks >= 1) both call :func:`init_update_group`.

vLLM's workers join through its ``stateless_init_torch_distributed_process_group`` (our worker
extension, :mod:`areal_mega.backends.vllm.worker_extension`), which meets another handshake:
the same ``tcp://`` store, but wrapped in ``PrefixStore("tcp://host:port")`` with a bare gloo
(or NCCL) backend under it. :func:`init_update_group` builds rank 0's side that way with
``handshake="vllm"``; the broadcasts are the same.

The group does not touch the default process group, so it coexists with the trainer's own
``torch.distributed`` world; it is registered with ranks 0..world_size-1 so that
``torch.distributed.broadcast(t, src=0, group=pg)`` works as on SGLang.
"""

from __future__ import annotations

import datetime
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


def weight_update_group(
    alloc: Optional[Allocation], backend: str, n_servers: Optional[int] = None
) -> WeightGroup:
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
        raise ConfigError(
            f"rollout.backend={backend!r} but allocation={alloc.canonical()!r} "
            f"names {alloc.rollout_backend!r} servers; make them agree"
        )
    if rollout is None:
        if backend in MULTI_RANK_BACKENDS:
            where = f"allocation={alloc.canonical()!r}" if alloc else "allocation"
            raise ConfigError(
                f"{where} has no rollout part, so the {_NAMES[backend]} servers' "
                "tensor parallel size is unknown; write it there, e.g. "
                f"'{backend}:d2t4+megatron:...' (with rollout.server_addrs set, "
                "no servers are launched)"
            )
        if n_servers is None:
            raise ConfigError(
                "weight_update_group: n_servers is needed without a rollout part in the allocation"
            )
        per = 1
    else:
        if n_servers is not None and n_servers != rollout.dp:
            raise ConfigError(
                f"rollout.server_addrs: {n_servers} server(s) but allocation="
                f"{alloc.canonical()!r} has d{rollout.dp}; make them agree"
            )
        if backend in MULTI_RANK_BACKENDS and rollout.pp > 1:
            raise ConfigError(
                f"allocation={alloc.canonical()!r}: {_NAMES[backend]} joins the "
                "weight group as rank_offset + tp_rank, so servers with p>1 "
                "would collide; use rollout.weight_update=disk"
            )
        per = rollout.tp if backend in MULTI_RANK_BACKENDS else 1
        n_servers = rollout.dp
    if n_servers < 1:
        raise ConfigError(
            f"rollout.server_addrs: {n_servers} servers; the weight group needs at least one"
        )
    return WeightGroup.of(n_servers, per)


#: how the servers build their side of the group (see the module docstring)
HANDSHAKES = ("sglang", "vllm")


def init_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    handshake: str = "sglang",
):
    """Join (rank 0: host) the weight-update group ``group_name``; blocks until all
    ``world_size`` ranks have joined or ``timeout_s`` passes. Returns the process group.
    ``handshake``: how the peers build theirs (``sglang``: SGLang and our CPU server; ``vllm``:
    vLLM's stateless group, see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: must be gloo or nccl")
    if not group_name:
        raise ValueError("group_name: must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    if handshake not in HANDSHAKES:
        raise ValueError(f"handshake={handshake!r}: must be one of {HANDSHAKES}")
    timeout = datetime.timedelta(seconds=timeout_s)
    # the store ``rendezvous("tcp://...")`` makes outside torchrun (rank 0 hosts it). Under
    # torchrun (TORCHELASTIC_USE_AGENT_STORE) rendezvous would make rank 0 a mere client of a
    # store nobody hosts, so it is built directly; the keys are the same.
    store = dist.TCPStore(
        master_address.strip("[]"),
        int(master_port),
        world_size,
        rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    store.set_timeout(timeout)
    if handshake == "vllm":
        pg = _stateless_group(
            store, master_address, master_port, world_size, rank, backend, timeout
        )
    else:
        store = c10d.PrefixStore(group_name, store)
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            store,
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _stateless_group(
    store, master_address: str, master_port: int, world_size: int, rank: int, backend: str, timeout
):
    """A process group as vLLM's stateless helper builds it: not in torch's group registry,
    its keys under the rendezvous URL."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    host = master_address.strip("[]")
    url = f"tcp://[{host}]:{master_port}" if ":" in host else f"tcp://{host}:{master_port}"
    prefix_store = c10d.PrefixStore(url, store)
    pg = c10d.ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        impl = c10d.ProcessGroupGloo(prefix_store, rank, world_size, timeout=timeout)
        kind, device = c10d.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        opts = c10d.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        impl = c10d.ProcessGroupNCCL(prefix_store, rank, world_size, opts)
        kind, device = c10d.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    pg._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, kind, impl)
    return pg


def destroy_update_group(pg) -> None:
    """Tear down a group made by :func:`init_update_group` (frees its name for reuse)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if pg is None:
        return
    if pg in c10d._world.pg_map:
        dist.destroy_process_group(pg)
    else:  # a stateless (vLLM handshake) group
        c10d._world.pg_group_ranks.pop(pg, None)
        pg.shutdown()


def broadcast_from_rank0(pg, tensor, watch=None, watch_every_s: float = 1.0) -> None:
    """Broadcast ``tensor`` in place from rank 0 of ``pg`` (blocking).

    ``watch`` (rank 0): called every ``watch_every_s`` while the collective is under way; it
    raises when a member has died. NCCL does not notice a dead peer before the group timeout,
    so without it the caller would wait that long; gloo fails on its own when a peer's
    connection resets, and the same loop serves both."""
    import time

    import torch.distributed as dist

    if watch is None:
        dist.broadcast(tensor, src=0, group=pg)
        return
    work = dist.broadcast(tensor, src=0, group=pg, async_op=True)
    nap, next_watch = 0.0, time.monotonic() + watch_every_s
    while not work.is_completed():
        time.sleep(nap)
        nap = min(0.005, nap + 0.0005)
        if time.monotonic() >= next_watch:
            watch()
            next_watch = time.monotonic() + watch_every_s
    work.wait()  # raises the collective's own error (gloo: a member's connection reset)

"""The weight-update process group, created the way SGLang creates it.

SGLang's ``init_weights_update_group`` (and AReaL's trainer, which copies it) builds the group
with torch's ``_new_process_group_helper`` on a ``tcp://`` rendezvous store wrapped in
``PrefixStore(group_name)``. The helper adds its own ``"{group_name}/"`` and per-device
(``"cpu/"``, ``"cuda/"``) prefixes and, for gloo, connects one context per device, so a group
built any other way (e.g. ``ProcessGroupGloo(PrefixStore(group_name, store), ...)``) never meets
an SGLang peer: both sides wait for keys the other never writes. The trainer's sender (rank 0)
and the CPU server (ranks >= 1) both call :func:`init_update_group`.

vLLM's workers join through its ``stateless_init_torch_distributed_process_group`` (our worker
extension, :mod:`areal_mega.backends.vllm.worker_extension`), which meets another handshake: the same
``tcp://`` store, but wrapped in ``PrefixStore("tcp://host:port")`` with a bare gloo (or NCCL)
backend under it. :func:`init_update_group` builds rank 0's side that way with
``handshake="vllm"``; the broadcasts are the same.

The group does not touch the default process group, so it coexists with the trainer's own
``torch.distributed`` world; it is registered with ranks 0..world_size-1 so that
``torch.distributed.broadcast(t, src=0, group=pg)`` works as on SGLang.
"""
from __future__ import annotations

import datetime


HANDSHAKES = ("sglang", "vllm")


def init_update_group(master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str, backend: str = "gloo", timeout_s: float = 300.0,
                      handshake: str = "sglang"):
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
    store = dist.TCPStore(master_address.strip("[]"), int(master_port), world_size,
                          rank == 0, timeout=timeout, multi_tenant=True)
    store.set_timeout(timeout)
    if handshake == "vllm":
        pg = _stateless_group(store, master_address, master_port, world_size, rank, backend,
                              timeout)
    else:
        store = c10d.PrefixStore(group_name, store)
        pg, _ = c10d._new_process_group_helper(
            world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
            backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _stateless_group(store, master_address: str, master_port: int, world_size: int, rank: int,
                     backend: str, timeout):
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
    else:                               # a stateless (vLLM handshake) group
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
    work.wait()     # raises the collective's own error (gloo: a member's connection reset)

"""The SGLang side of the weight-update protocol, written independently of areal_mega following
SGLang's source, so that the interop tests prove compatibility rather than self-consistency.

- :func:`sglang_init_custom_process_group` follows ``init_custom_process_group`` in SGLang's
  ``python/sglang/srt/utils/common.py`` (v0.5.x) step by step (AReaL's
  ``areal/engine/core/distributed.py`` is the same function): ``rendezvous`` on the
  ``tcp://`` init method, ``store.set_timeout``, ``PrefixStore(group_name, store)``, then
  ``_new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
  backend_options=pg_options, timeout=timeout)`` (the keyword is ``backend_options`` since
  torch 2.6) and ``_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}``.
- Run as a script it is a stand-in SGLang server for the two weight endpoints, doing what
  ``ModelRunner.init_weights_update_group`` / ``update_weights_from_distributed`` in SGLang's
  ``python/sglang/srt/model_executor/model_runner.py`` do: join as ``rank_offset + tp_rank``
  (tp_rank 0); per bucket allocate ``torch.empty(shape, dtype=getattr(torch, dtype))`` and
  ``torch.distributed.broadcast(weight, src=0, group=..., async_op=True)`` for each tensor,
  then wait on all handles. Instead of loading into a model it saves each bucket to
  ``--out-dir/bucket-<i>.pt`` so the test can compare the tensors.

    python -m tests.helpers.sglang_peer_worker --port P --out-dir DIR [--group-timeout-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os

import torch


def sglang_init_custom_process_group(backend, init_method, timeout, world_size, rank, group_name):
    """SGLang's ``init_custom_process_group`` (see the module docstring)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    backend = Backend(backend)
    rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
    store, rank, world_size = next(rendezvous_iterator)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def main() -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--group-timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    groups: dict = {}
    buckets = [0]

    def init_group(body: dict) -> None:
        rank = int(body["rank_offset"]) + 0  # + tp_rank
        groups[body.get("group_name", "weight_update_group")] = sglang_init_custom_process_group(
            backend=body.get("backend", "nccl"),
            init_method=f"tcp://{body['master_address']}:{body['master_port']}",
            timeout=datetime.timedelta(seconds=args.group_timeout_s),
            world_size=int(body["world_size"]),
            rank=rank,
            group_name=body.get("group_name", "weight_update_group"),
        )

    def receive(body: dict) -> None:
        pg = groups[body.get("group_name", "weight_update_group")]
        weights, handles = [], []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(torch.distributed.broadcast(weight, src=0, group=pg, async_op=True))
            weights.append((name, weight))
        for h in handles:
            h.wait()
        torch.save(dict(weights), os.path.join(args.out_dir, f"bucket-{buckets[0]}.pt"))
        buckets[0] += 1

    def endpoint(fn):
        async def handler(request):
            body = await request.json()
            await asyncio.get_running_loop().run_in_executor(None, fn, body)
            return web.json_response({"success": True, "message": "ok"})

        return handler

    async def health(request):
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/init_weights_update_group", endpoint(init_group))
    app.router.add_post("/update_weights_from_distributed", endpoint(receive))
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()

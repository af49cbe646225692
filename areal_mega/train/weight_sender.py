"""Trainer side of the distributed weight update: bucket planning (pure) and the sender.

The sender owns rank 0 of a process group shared with every rollout server (server i joins as
rank 1 + i·tp through ``/init_weights_update_group``). For each bucket it POSTs
``/update_weights_from_distributed {names, dtypes, shapes}`` to every server and, while those
requests are in flight, broadcasts the bucket's tensors one by one (root 0) in the listed order,
which is exactly what SGLang's receiver expects. Gloo on CPU, NCCL on GPU. The group itself is
created the SGLang way (see :mod:`areal_mega.parallel.weight_group`), so real SGLang servers and
the CPU server both meet it.

A server that dies before or during a broadcast does not end the trainer: before each bucket
(and every second while its collective runs) every member is checked for liveness
(``GET /get_model_info``: a refused or reset connection is death; any answer, or a slow one,
is a live server), so NCCL, which does not notice a dead peer before the group timeout, is
never left waiting for it; gloo also fails on its own when a peer's connection resets. Either way
the
sender tears its side of the group down at once (the survivors' receives then fail too,
instead of at the group timeout) and raises :class:`WeightBroadcastError`;
:func:`broadcast_version` then asks the rollout worker for the members again (it probes them,
the dead one is left out and, relaunched, rejoins by the usual join path), forms the group with
the survivors and sends the whole version again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
from typing import Callable, Iterable, Iterator, Optional

import aiohttp

from areal_mega.backends.clients import client_class, group_handshake
from areal_mega.common.net import free_port
from areal_mega.parallel.weight_group import (
    broadcast_from_rank0,
    destroy_update_group,
    init_update_group,
    weight_update_group,
)
from areal_mega.rollout.client import RolloutRequestError, server_url

log = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def tensor_nbytes(shape, dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (name or torch dtype)."""
    name = dtype_name(dtype)
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: unknown size; known: {sorted(_DTYPE_BYTES)}")
    n = 1
    for d in shape:
        n *= int(d)
    return n * _DTYPE_BYTES[name]


def iter_buckets(items: Iterable, size_of: Callable, bucket_bytes: int) -> Iterator[list]:
    """Group ``items`` in order into consecutive buckets of at most ``bucket_bytes``; an item
    larger than the budget gets a bucket of its own. Never yields an empty bucket."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
    bucket, used = [], 0
    for it in items:
        sz = size_of(it)
        if bucket and used + sz > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append(it)
        used += sz
    if bucket:
        yield bucket


def plan_weight_buckets(named_shapes_dtypes: Iterable, bucket_bytes: int) -> list:
    """Pure plan: ``[(name, shape, dtype), ...]`` -> list of buckets (lists of those triples),
    order preserved, each bucket ≤ ``bucket_bytes`` unless a single tensor is larger.
    Duplicate names are an error."""
    items = [(n, tuple(int(d) for d in s), dtype_name(dt)) for n, s, dt in named_shapes_dtypes]
    seen = set()
    for n, _, _ in items:
        if n in seen:
            raise ValueError(f"plan_weight_buckets: duplicate tensor name {n!r}")
        seen.add(n)
    return list(iter_buckets(items, lambda it: tensor_nbytes(it[1], it[2]), bucket_bytes))


class WeightBroadcastError(RuntimeError):
    """A weight broadcast that did not reach every member: one died before or during it (the
    message says which and where). The sender has already torn its side of the group down;
    :meth:`DistributedWeightSender.regroup` forms it again."""


def create_sender_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    handshake: str = "sglang",
):
    """Rank 0 of the weight-update group (hosts the TCP store), built exactly as the servers
    build theirs (SGLang's way, or vLLM's stateless group with ``handshake="vllm"``:
    :func:`~areal_mega.parallel.weight_group.init_update_group`). Does not touch the default
    process group, so it coexists with the trainer's own ``torch.distributed`` world. Blocks
    until every server has joined."""

    return init_update_group(
        master_address,
        master_port,
        world_size,
        0,
        group_name,
        backend,
        timeout_s,
        handshake=handshake,
    )


class DistributedWeightSender:
    """Pushes HF-named tensors to every server over a broadcast group, bucket by bucket.

    ``run_async(coro)`` must run a coroutine on the loop that owns ``client`` and return a
    ``concurrent.futures.Future`` (the :class:`RolloutController` provides it); pass None to
    run the client on a private event loop thread. ``group`` (a
    :class:`~areal_mega.parallel.weight_group.WeightGroup`) gives the world size and each
    server's rank offset; the trainer builds it from the allocation string. :meth:`regroup`
    changes the client's servers through its public ``set_servers``.
    """

    def __init__(
        self,
        client,
        *,
        master_address: str = "127.0.0.1",
        master_port: Optional[int] = None,
        backend: str = "gloo",
        group_name: str = "areal_weight_update",
        bucket_bytes: int = 512 << 20,
        group=None,
        run_async=None,
        timeout_s: float = 300.0,
        liveness_timeout_s: float = 5.0,
        handshake: str = "sglang",
    ):
        self.client = client
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self.backend = backend
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        # world size and rank offsets: the launcher's arithmetic (parallel.weight_group);
        # without a group, every server is a single rank (local backend)
        self.group = group or weight_update_group(None, "local", len(client.addrs))
        self.timeout_s = timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self._own_loop = run_async is None
        self._run_async = run_async or _private_loop()
        self.handshake = handshake
        self.pg = None
        self.buckets_sent = 0

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def connect(self) -> None:
        """Create the group: POST ``/init_weights_update_group`` to every server and join as
        rank 0 concurrently."""
        fut = self._run_async(
            self.client.init_weights_update_group(
                self.master_address,
                self.master_port,
                self.world_size,
                self.group_name,
                self.backend,
                self.group.rank_offsets,
            )
        )
        try:
            self.pg = create_sender_group(
                self.master_address,
                self.master_port,
                self.world_size,
                self.group_name,
                self.backend,
                self.timeout_s,
                self.handshake,
            )
        except BaseException:
            fut.cancel()
            raise
        fut.result(timeout=self.timeout_s)

    def regroup(self, addrs: list, force: bool = False) -> bool:
        """Form the group again for a new server list (elastic rollout: servers joined or
        left): ``/destroy_weights_update_group`` on the current servers (best effort: a removed
        one may be gone), destroy rank 0's side, then :meth:`connect` with world size
        1 + len(addrs) x ranks per server on a fresh port. Returns False, doing nothing, when
        ``addrs`` are already the group's servers, in order, unless ``force`` (a member was
        relaunched and holds no group) or a failed broadcast tore the group down."""

        urls = [server_url(a) for a in addrs]
        if not urls:
            raise ValueError("regroup: the weight-update group needs at least one server")
        if urls == self.client.addrs and not force and self.pg is not None:
            return False
        try:
            self._run_async(self.client.destroy_weights_update_group(self.group_name)).result(
                timeout=self.timeout_s
            )
        except Exception as e:  # noqa: BLE001 - the survivors re-init below (and say so)
            log.warning("destroying the old weight-update group: %s", e)
        self._drop_group()
        self.client.set_servers(urls)
        self.group = self.group.resized(len(urls))
        self.master_port = free_port(self.master_address)
        self.connect()
        log.info(
            "weight-update group formed again: %d servers, world size %d",
            len(urls),
            self.world_size,
        )
        return True

    def send(self, named_tensors: Iterable, weight_version: Optional[int] = None) -> int:
        """Stream ``(hf_name, tensor)`` pairs to the servers in buckets; returns the number of
        buckets. Tensors are sent contiguous, on the group's device, in their own dtype.
        ``weight_version`` (if given) is attached to every bucket; the server reports it once
        the last bucket has landed (attach it to the last bucket only if that matters)."""

        if self.pg is None:
            raise RuntimeError("DistributedWeightSender.send before connect()")
        n = 0
        for bucket in iter_buckets(
            named_tensors, lambda it: it[1].numel() * it[1].element_size(), self.bucket_bytes
        ):
            self._check_members(f"before bucket {n + 1}")  # never start a collective without one
            names = [nm for nm, _ in bucket]
            fut = self._run_async(
                self._post_bucket(
                    names,
                    [dtype_name(t.dtype) for _, t in bucket],
                    [list(t.shape) for _, t in bucket],
                    weight_version,
                )
            )
            failure = self._broadcast_bucket(bucket, fut)
            if failure is not None:
                self._drop_group()  # the survivors' receives fail now, not at the timeout
                try:
                    fut.result(timeout=min(60.0, self.timeout_s))  # ... and they answer
                except Exception:  # noqa: BLE001 - their failed receives: expected
                    pass
                raise WeightBroadcastError(f"weight broadcast failed in bucket {n + 1}: {failure}")
            n += 1
        self._run_async(self.client.weights_received(weight_version)).result(self.timeout_s)
        self.buckets_sent += n
        return n

    async def _post_bucket(self, names, dtypes, shapes, weight_version) -> None:
        """``POST /update_weights_from_distributed`` to every member, as the client's method
        of that name does, but every answer is awaited before the first error is raised: after
        a failed broadcast no survivor is still receiving when the group is formed again."""
        body: dict = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": self.group_name,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        outs = await asyncio.gather(
            *(
                self.client.request(
                    a,
                    "POST",
                    "/update_weights_from_distributed",
                    body,
                    timeout=self.client.control_timeout_s,
                )
                for a in self.client.addrs
            ),
            return_exceptions=True,
        )
        for e in outs:
            if isinstance(e, BaseException):
                raise e

    def _broadcast_bucket(self, bucket, fut) -> Optional[str]:
        """Broadcast one bucket and wait for every member's answer; returns why it failed (a
        member died: the collective or its request failed), or None. The error is not kept:
        its traceback would keep the process group, and with it the connections, alive."""
        try:
            for _, t in bucket:
                broadcast_from_rank0(
                    self.pg,
                    t.detach().contiguous(),
                    watch=lambda: self._check_members("during the collective"),
                )
            fut.result(timeout=self.timeout_s)
            return None
        except RolloutRequestError:
            fut.cancel()
            raise  # a request the servers refuse: a retry cannot cure it
        except WeightBroadcastError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL errors, a member's HTTP failure
            return f"{type(e).__name__}: {e}"

    def dead_members(self, addrs: Optional[list] = None) -> list:
        """The servers among ``addrs`` (default: the group's) whose connection to
        ``GET /get_model_info`` is refused or reset: dead processes. Any HTTP answer, even an
        error, comes from a live process, and a slow answer is a busy server."""
        addrs = list(self.client.addrs if addrs is None else addrs)

        async def dead(addr: str) -> bool:
            try:
                await self.client.request(
                    addr, "GET", "/get_model_info", timeout=self.liveness_timeout_s
                )
            except (aiohttp.ClientConnectionError, ConnectionError):
                return True
            except Exception:  # noqa: BLE001 - timeouts and HTTP errors: alive
                return False
            return False

        async def all_dead() -> list:
            return list(await asyncio.gather(*(dead(a) for a in addrs)))

        flags = self._run_async(all_dead()).result(self.liveness_timeout_s + 30)
        return [a for a, d in zip(addrs, flags) if d]

    def _check_members(self, where: str) -> None:
        dead = self.dead_members()
        if dead:
            raise WeightBroadcastError(f"rollout server(s) {', '.join(dead)} died ({where})")

    def _drop_group(self) -> None:
        """Destroy rank 0's side of the group and let go of it: its connections close only
        once nothing refers to it, and then a member blocked in a receive fails at once."""
        pg, self.pg = self.pg, None
        destroy_update_group(pg)
        del pg
        gc.collect()

    def close(self) -> None:
        """Destroy the group on this side (the servers keep theirs until
        ``/destroy_weights_update_group``) and close the client if this sender owns its loop."""

        self._drop_group()
        if self._own_loop:
            self._run_async(self.client.close()).result(timeout=30)


def _private_loop():
    """A background event loop thread; returns ``run_async(coro) -> Future``."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="weight-sync-loop", daemon=True).start()

    def run_async(coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, loop)

    return run_async


def broadcast_version(
    sender,
    link,
    make_stream: Callable,
    version: int,
    *,
    agree: Callable[[bool], bool],
    attempts: int = 3,
) -> dict:
    """Publish ``version`` by broadcast, surviving a server death (see the module docstring).

    Collective over the trainer's ranks: every rank calls it, with ``make_stream`` returning a
    fresh ``(hf_name, tensor)`` stream (the TP/EP gathers every rank takes part in); rank 0
    passes its :class:`DistributedWeightSender` and control link, the other ranks None.
    ``agree(flag)`` returns rank 0's ``flag`` on every rank. Rank 0 asks the rollout worker to
    pause (it answers the live servers the group must hold), forms the group again when they
    changed and broadcasts. When a member dies (:class:`WeightBroadcastError`) every rank runs
    its stream to the end, so the gathers stay matched, and the whole version is sent again to
    the survivors, at most ``attempts`` times in all; then the error is raised (the trainer
    exits and is relaunched). Returns the worker's ``end_update`` answer on rank 0, ``{}``
    elsewhere."""
    failure = None
    for attempt in range(1, attempts + 1):
        failure = None
        stream = None
        try:
            if sender is not None:
                begun = link.begin_update()
                members = begun.get("servers") or sender.client.addrs
                dead = sender.dead_members(members)  # the worker probed; a last look
                members = [a for a in members if a not in dead]
                if not members:
                    raise WeightBroadcastError("no live rollout server to broadcast to")
                sender.regroup(members, force=bool(begun.get("reform")))
            stream = make_stream()
            if sender is not None:
                sender.send(stream, weight_version=version)
        except WeightBroadcastError as e:
            failure = str(e)
        for _ in stream if stream is not None else make_stream():
            pass  # what is left of it: the other ranks' gathers run to the end
        if not agree(failure is not None):
            return link.end_update(version=version) if sender is not None else {}
        if sender is not None:
            log.warning(
                "weight version %d, attempt %d/%d: %s; sending it again to the survivors",
                version,
                attempt,
                attempts,
                failure,
            )
    raise WeightBroadcastError(
        f"weight version {version} not sent after {attempts} attempts: {failure or 'rank 0 failed'}"
    )


def connect_weight_sender(cfg, group) -> DistributedWeightSender:
    """Trainer rank 0 joins a broadcast group with every rollout server (SGLang's
    ``/init_weights_update_group``): NCCL on GPU, gloo on CPU. ``group``: the weight-update
    group plan of ``cfg`` (:func:`areal_mega.train.session.weight_group_for`)."""
    import os

    import torch

    r = cfg.rollout
    if not r.server_addrs:
        raise ValueError("rollout.weight_update=distributed needs rollout.server_addrs")
    client = client_class(r.backend)(
        r.server_addrs, api_key=r.api_key, timeout_s=r.request_timeout_s, retries=r.request_retries
    )
    sender = DistributedWeightSender(
        client,
        master_address=os.environ.get("MASTER_ADDR", cfg.cluster.master_addr),
        backend="nccl" if torch.cuda.is_available() else "gloo",
        bucket_bytes=r.weight_bucket_mb << 20,
        group=group,
        handshake=group_handshake(r.backend),
    )
    sender.connect()
    return sender

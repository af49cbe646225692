"""``launch.local``'s side of elastic rollout: the server membership of a running job.

:class:`ScaleService` answers ``python -m areal_mega.launch.scale`` on the launcher's control
socket (:attr:`areal_mega.run_dir.RunDir.launcher_endpoint`, the JSON protocol of
:mod:`areal_mega.dataplane.control`). Every command is answered at once:

- ``{"cmd": "list"}`` (read-only) -> every member ``{id, addr, owned, gpus, state}`` (state:
  ``serving``, ``draining``, ``leaving``, ``relaunching``), the ``operations`` in progress
  (queued or running scale commands and the supervisor's server relaunches, each with its
  state and seconds so far) and the rollout worker's per-server counters;
- ``{"cmd": "op", "op": ID}`` (read-only) -> that operation's state, and once it ended its
  ``result`` or ``error``;
- the mutating commands below are queued as operations (:mod:`areal_mega.launch.operations`),
  run one at a time, each within its own ``timeout_s`` (default :data:`DEFAULT_OP_TIMEOUT_S`),
  and answered with the operation's id for ``op`` polls:
- ``{"cmd": "add", "n": N}`` -> start N local servers (CPU, or GPU with the recipe's rollout
  TP on free GPUs of this machine), wait until they answer, then have the rollout worker bring
  each to the current weights and dispatch to it; ids ``rollout<k>``;
- ``{"cmd": "add_addr", "addr": "host:port"}`` -> attach an external server; id ``ext<k>``;
- ``{"cmd": "remove", "id": ID, "drain": bool}`` -> the worker stops dispatching to it (and
  drains or interrupts its requests), then a server this launcher started is stopped.

``launch.local`` owns the servers it starts: they run under its supervisor (a dead one is
relaunched and re-synced, within ``cluster.max_restarts``), ``remove`` stops them and the end
of the run stops them all. A request that cannot be applied (unknown id, unreachable address,
the last server, no free GPU) gets an error and changes nothing. An operation that runs out of
time ends with an error that says what was left: a server that never became ready is stopped
and not added; a drain that never ends is cut short (the rest of its requests resume on other
servers) and the server is removed. With distributed weight updates a joining server takes
requests after the trainer's next broadcast, which forms the weight-update group again with it
(:meth:`DistributedWeightSender.regroup
<areal_mega.train.weight_sender.DistributedWeightSender.regroup>`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

from areal_mega.common.files import atomic_write
from areal_mega.common.net import free_ports
from areal_mega.dataplane.control import ControlError, ControlServer, RolloutLink
from areal_mega.launch.operations import Operation, OperationQueue
from areal_mega.launch.plan import ServerSlot
from areal_mega.launch.supervisor import ProcessSpec
from areal_mega.rollout.server_pool import NOT_GENERATING_YET

log = logging.getLogger(__name__)

DEFAULT_OP_TIMEOUT_S = 900.0
"""An operation's deadline when the command names none (``launch.scale --timeout``)."""
POOL_QUERY_S = 0.5
"""How long ``list`` waits for the rollout worker's counters (it answers within a second)."""
DRAIN_MARGIN_S = 5.0
"""Of a ``remove --drain``'s time, what is kept to interrupt the rest and stop the server."""


class ScaleError(ValueError):
    """A scale request that cannot be applied; nothing was changed."""


def free_gpus(n_gpus: int, used: set, per_server: int, n_servers: int) -> list:
    """GPU tuples for ``n_servers`` new servers of ``per_server`` GPUs each among GPUs
    ``0..n_gpus-1`` minus ``used`` (pure); ``ScaleError`` when there are too few."""
    free = [g for g in range(n_gpus) if g not in used]
    need = per_server * n_servers
    if len(free) < need:
        raise ScaleError(
            f"{n_servers} server(s) x {per_server} GPU(s) need {need} free GPUs; "
            f"{len(free)} free of cluster.n_gpus_per_node={n_gpus} "
            f"(in use: {sorted(used)})"
        )
    return [tuple(free[i * per_server : (i + 1) * per_server]) for i in range(n_servers)]


class ScaleService:
    """Membership of the run's rollout servers, owned by ``launch.local`` (module docstring).

    ``make_spec(slot) -> ProcessSpec`` builds a local server's spec (as at launch); ``members``
    are the servers at launch: ``{id: {"addr", "owned", "gpus"}}``; ``gpu_info`` is
    ``(n_gpus_per_node, gpus_per_server, trainer_gpus)`` on GPU, None on CPU."""

    def __init__(
        self,
        cfg,
        supervisor,
        paths,
        make_spec,
        members: dict,
        *,
        host: str = "127.0.0.1",
        gpu_info: Optional[tuple] = None,
        distributed_updates: bool = False,
    ):
        self.cfg, self.sup, self.paths = cfg, supervisor, paths
        self.make_spec = make_spec
        self.members = dict(members)
        self.host = host
        self.gpu_info = gpu_info
        self.distributed_updates = distributed_updates
        self._next = {
            "rollout": len([m for m in members if m.startswith("rollout")]),
            "ext": len([m for m in members if m.startswith("ext")]),
        }
        self._leaving: dict = {}  # id -> "draining" / "leaving" (a remove runs)
        self._requests: dict = {}  # request_id -> op id (resent commands)
        self._pool: Optional[dict] = None  # the worker's last counters, and when
        self._pool_at = 0.0
        self._save()
        self.ops = OperationQueue()
        self.link = RolloutLink(
            paths.control_endpoint,
            secret=cfg.dataplane.secret,
            timeout_s=cfg.rollout.request_timeout_s,
        )
        # list's own link (the operation thread holds the other one while it waits)
        self.pool_link = RolloutLink(
            paths.control_endpoint, secret=cfg.dataplane.secret, timeout_s=POOL_QUERY_S
        )
        self.server = ControlServer(
            paths.launcher_endpoint, self.handle, secret=cfg.dataplane.secret
        ).start()

    def _save(self) -> None:
        """Write the member addresses for a relaunched rollout worker (atomically; durable
        too, as it changes only when servers join or leave)."""
        atomic_write(
            self.paths.rollout_servers_file,
            json.dumps(
                {"addrs": [m["addr"] for m in self.members.values()], "ids": list(self.members)}
            ),
            durable=True,
        )

    def close(self) -> None:
        """Stop answering and close the sockets."""
        self.server.close()
        self.ops.close()
        self.link.close()
        self.pool_link.close()

    def _new_id(self, kind: str) -> str:
        while f"{kind}{self._next[kind]}" in self.members:
            self._next[kind] += 1
        sid = f"{kind}{self._next[kind]}"
        self._next[kind] += 1
        return sid

    def handle(self, msg: dict) -> dict:
        """Answer one command (see the module docstring) at once; runs on the control thread.
        Reads (``list``, ``op``) never wait for an operation; a mutating command is queued
        and answered with its operation (``{"op", "state", ...}``). A command resent with the
        same ``request_id`` (the client saw the socket drop and sent it again) gets its first
        operation instead of running twice."""
        cmd = msg["cmd"]
        if cmd == "list":
            return self.list()
        if cmd == "op":
            op = self.ops.get(str(msg.get("op")))
            if op is None:
                raise ScaleError(f"op: unknown operation {msg.get('op')!r}")
            return op.view()
        rid = msg.get("request_id")
        if rid is not None and rid in self._requests:
            return self.ops.get(self._requests[rid]).view()
        fn, target = self._operation(cmd, msg)
        timeout = msg.get("timeout_s", DEFAULT_OP_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ScaleError(f"{cmd}: timeout_s={timeout!r}: must be a number > 0")
        op = self.ops.submit(cmd, target, fn, timeout)
        if rid is not None:
            self._requests[rid] = op.op
            while len(self._requests) > 64:
                self._requests.pop(next(iter(self._requests)))
        return op.view()

    def _operation(self, cmd: str, msg: dict) -> tuple:
        """``(fn(op) -> result, target)`` of a mutating command; ``ScaleError`` for bad
        arguments (checked before anything is queued)."""
        if cmd == "add":
            n = msg.get("n")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ScaleError(f"add: n={n!r}: must be an integer >= 1")
            return (lambda op: {"added": self._add_local(n, op)}), f"{n} server(s)"
        if cmd == "add_addr":
            addr = str(msg.get("addr") or "")
            return (lambda op: {"added": [self._attach(addr, op)]}), addr
        if cmd == "remove":
            sid, drain = str(msg.get("id") or ""), bool(msg.get("drain", False))
            return (lambda op: self._remove(sid, drain, op)), sid
        raise ScaleError(f"unknown command {cmd!r}; expected list, op, add, add_addr or remove")

    def list(self) -> dict:
        """Members (with ``state``: serving, draining, leaving, relaunching), the operations
        in progress, and the rollout worker's per-server counters: asked for at most
        :data:`POOL_QUERY_S`; a worker busy with a weight update or a drain leaves the last
        counters it gave, with their age in ``pool_age_s``."""
        members = dict(self.members)
        relaunching = dict(self.sup.relaunching)
        now = time.monotonic()
        out = []
        for sid, m in members.items():
            state = self._leaving.get(sid, "serving")
            if sid in relaunching and state == "serving":
                state = "relaunching"
            out.append({"id": sid, **m, "state": state})
        ops = self.ops.active()
        ops += [
            {
                "op": f"relaunch-{name}",
                "cmd": "relaunch",
                "target": name,
                "state": "relaunching",
                "seconds": round(now - since, 2),
            }
            for name, since in relaunching.items()
            if name in members
        ]
        try:
            pool = self.pool_link.request({"cmd": "servers"}, timeout_s=POOL_QUERY_S)
            pool.pop("ok", None)
            self._pool, self._pool_at = pool, time.monotonic()
            age = 0.0
        except Exception as e:  # noqa: BLE001 - listing still works without the worker
            if self._pool is None:
                pool, age = {"error": str(e)}, None
            else:
                pool, age = dict(self._pool), round(time.monotonic() - self._pool_at, 1)
        return {"members": out, "operations": ops, "pool": pool, "pool_age_s": age}

    def _add_local(self, n: int, op: Operation) -> list:
        """Start ``n`` servers together, wait until each answers, then have the worker join
        them one by one; a server that fails to come up or to join (within the operation's
        timeout) is stopped, the ones before it stay (each is reported)."""
        gpus: list = [()] * n
        if self.gpu_info is not None:
            n_gpus, per_server, trainer_gpus = self.gpu_info
            used = set(trainer_gpus) | {g for m in self.members.values() for g in m["gpus"]}
            gpus = free_gpus(n_gpus, used, per_server, n)
        ports = free_ports(n, self.host)
        started = []
        for g, port in zip(gpus, ports):
            sid = self._new_id("rollout")
            spec: ProcessSpec = self.make_spec(ServerSlot(int(sid[len("rollout") :]), 0, g, port))
            if spec.name != sid:
                raise RuntimeError(f"make_spec named the server {spec.name!r}, expected {sid!r}")
            started.append((sid, spec, g, port, self.sup.call(lambda s, sp=spec: s.add(sp))))
        op.state = "starting " + ", ".join(s[0] for s in started)
        added, error = [], None
        for sid, spec, g, port, run in started:
            if error is None:
                error = self._wait_ready(sid, spec, run, op)
            if error is None:
                addr = f"{self.host}:{port}"
                op.state = f"joining {sid}"
                try:
                    joined = self._join(addr, op)
                except Exception as e:  # noqa: BLE001 - reported after the cleanup
                    error = e
                    self._forget(addr)
                else:
                    self.members[sid] = {"addr": addr, "owned": True, "gpus": list(g)}
                    self._save()
                    self.sup.say(
                        f"{sid} ({addr}) joined the rollout at version {joined.get('version')}"
                    )
                    added.append({"id": sid, "addr": addr, "version": joined.get("version")})
                    continue
            self.sup.call(lambda s, name=sid: s.retire(name))
        if error is not None:
            done = f" (added: {', '.join(a['id'] for a in added)})" if added else ""
            raise ScaleError(f"add: {error}{done}")
        return added

    def _wait_ready(self, sid: str, spec: ProcessSpec, run, op: Operation) -> Optional[str]:
        """None once ``sid`` answers its readiness probe, else why it did not (it exited, or
        did not answer within its ``ready_timeout_s`` or the operation's timeout)."""
        limit = min(spec.ready_timeout_s, op.remaining())
        deadline = time.monotonic() + limit
        while True:
            if run.proc.poll() is not None:
                return (
                    f"{sid} exited (code {run.proc.returncode}) before it was ready; see "
                    f"{run.log.name}"
                )
            try:
                if spec.ready():
                    return None
            except Exception:  # noqa: BLE001 - still booting
                pass
            if time.monotonic() > deadline:
                return (
                    f"{sid} not ready after {limit:.0f}s (cluster.server_ready_timeout_s="
                    f"{spec.ready_timeout_s:.0f}, launch.scale --timeout="
                    f"{op.timeout_s:.0f}); it was stopped; see {run.log.name}"
                )
            time.sleep(0.2)

    def _attach(self, addr: str, op: Operation) -> dict:
        if any(m["addr"] == addr for m in self.members.values()):
            raise ScaleError(f"add_addr: {addr} is already a member")
        op.state = f"joining {addr}"
        try:
            joined = self._join(addr, op)
        except ControlError as e:
            if "did not answer" in str(e):
                self._forget(addr)
            raise
        sid = self._new_id("ext")
        self.members[sid] = {"addr": addr, "owned": False, "gpus": []}
        self._save()
        self.sup.say(
            f"{sid} ({addr}, external) joined the rollout at version {joined.get('version')}"
        )
        return {"id": sid, "addr": addr, "version": joined.get("version")}

    def _join(self, addr: str, op: Operation) -> dict:
        """Have the worker add ``addr``: at the current weights from disk, or (distributed
        weight updates) pending the trainer's next broadcast to a group that includes it. A
        worker that is (re)starting and has no weights yet is asked again until the
        operation's deadline."""
        while True:
            try:
                return self.link.request(
                    {"cmd": "add_server", "addr": addr, "via_group": self.distributed_updates},
                    timeout_s=op.check(f"joining {addr}"),
                )
            except ControlError as e:
                if NOT_GENERATING_YET not in str(e):
                    raise
                time.sleep(0.2)

    def _forget(self, addr: str) -> None:
        """A join whose answer never came may still complete in the worker (it runs its
        commands in order): have it drop ``addr`` again, so that its pool and the member
        list agree. Best effort: the error the caller reports stands either way."""
        try:
            self.link.request(
                {"cmd": "remove_server", "addr": addr, "drain": False}, timeout_s=POOL_QUERY_S * 20
            )
        except Exception as e:  # noqa: BLE001 - "not in the pool" is the expected answer
            log.info("dropping %s from the worker after a failed join: %s", addr, e)

    def _remove(self, sid: str, drain: bool, op: Operation) -> dict:
        if sid not in self.members:
            raise ScaleError(
                f"remove: unknown server id {sid!r}; members: {', '.join(self.members) or 'none'}"
            )
        m = self.members[sid]
        self._leaving[sid] = op.state = ("draining " if drain else "leaving ") + sid
        try:
            out = self._remove_from_worker(sid, m["addr"], drain, op)
        finally:
            self._leaving.pop(sid, None)
        del self.members[sid]
        self._save()
        if m["owned"]:
            op.state = f"stopping {sid}"
            self.sup.call(lambda s: s.retire(sid))
        how = "drained" if out.get("drained") else "its requests resume elsewhere"
        self.sup.say(
            f"{sid} ({m['addr']}) left the rollout ({how}; {out.get('aborted', 0)} interrupted)"
        )
        if drain and out.get("drain_timed_out"):
            raise ScaleError(
                f"remove {sid} --drain: its requests did not finish within the "
                f"operation's {op.timeout_s:.0f} s (launch.scale --timeout); the "
                f"{out.get('aborted', 0)} left were interrupted and resume on "
                f"other servers; {sid} was removed"
            )
        return {"id": sid, **out}

    def _remove_from_worker(self, sid: str, addr: str, drain: bool, op: Operation) -> dict:
        """The worker's ``remove_server``; a drain gets the operation's time less a margin,
        after which the worker interrupts what is left. A broadcast in progress holds the
        server in its group, and a (re)starting worker has no pool yet: retried until the
        operation's deadline."""
        while True:
            left = op.check(f"remove {sid}")
            try:
                return self.link.request(
                    {
                        "cmd": "remove_server",
                        "addr": addr,
                        "drain": drain,
                        "drain_timeout_s": max(0.0, left - DRAIN_MARGIN_S),
                    },
                    timeout_s=left,
                )
            except ControlError as e:
                if "broadcast is in progress" not in str(e) and NOT_GENERATING_YET not in str(e):
                    raise
                time.sleep(0.2)


def start_scale_service(
    cfg,
    supervisor,
    paths,
    layout,
    make_spec,
    *,
    host: str = "127.0.0.1",
    distributed_updates: bool = False,
    addrs: Optional[dict] = None,
    gpus: bool = True,
) -> ScaleService:
    """The :class:`ScaleService` of a run that ``launch.local`` started with ``layout``: its
    members are the external ``rollout.server_addrs`` (``ext<k>``) and the launched servers
    (``rollout<k>``, the supervisor's process names). ``addrs`` (server index -> host:port)
    when they are not all on ``host`` (``launch.ray``); ``gpus=False`` when the new servers'
    GPUs are not picked from this machine's (``launch.ray``: Ray assigns them)."""
    members = {
        f"ext{i}": {"addr": a, "owned": False, "gpus": []}
        for i, a in enumerate(cfg.rollout.server_addrs)
    }
    for slot in layout.servers:
        members[f"rollout{slot.index}"] = {
            "addr": (addrs or {}).get(slot.index, f"{host}:{slot.port}"),
            "owned": True,
            "gpus": list(slot.gpus or ()),
        }
    a = layout.allocation
    gpu_info = None
    if gpus and layout.device != "cpu" and a.rollout is not None:
        gpu_info = (
            cfg.cluster.n_gpus_per_node,
            a.rollout.tp * a.rollout.pp,
            tuple(layout.trainer_gpus),
        )
    return ScaleService(
        cfg,
        supervisor,
        paths,
        make_spec,
        members,
        host=host,
        gpu_info=gpu_info,
        distributed_updates=distributed_updates,
    )

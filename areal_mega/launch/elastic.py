"""``launch.local``'s side of elastic rollout: the server membership of a running job.

:class:`ScaleService` answers ``python -m areal_mega.launch.scale`` on the launcher's control
socket (:attr:`areal_mega.run_dir.RunDir.launcher_endpoint`, the JSON protocol of
:mod:`areal_mega.dataplane.control`). Commands:

- ``{"cmd": "list"}`` -> every member ``{id, addr, owned, gpus}`` and the rollout worker's
  per-server counters;
- ``{"cmd": "add", "n": N}`` -> start N local servers (CPU, or GPU with the recipe's rollout
  TP on free GPUs of this machine), wait until they answer, then have the rollout worker bring
  each to the current weights and dispatch to it; ids ``rollout<k>``;
- ``{"cmd": "add_addr", "addr": "host:port"}`` -> attach an external server; id ``ext<k>``;
- ``{"cmd": "remove", "id": ID, "drain": bool}`` -> the worker stops dispatching to it (and
  drains or interrupts its requests), then a server this launcher started is stopped.

``launch.local`` owns the servers it starts: they run under its supervisor (a dead one is
relaunched and re-synced, within ``cluster.max_restarts``), ``remove`` stops them and the end
of the run stops them all. A request that cannot be applied (unknown id, unreachable address,
the last server, no free GPU) gets an error and changes nothing. With distributed weight
updates a joining server takes requests after the trainer's next broadcast, which forms the
weight-update group again with it (:meth:`DistributedWeightSender.regroup
<areal_mega.train.weight_sender.DistributedWeightSender.regroup>`).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional

from areal_mega.common.files import atomic_write
from areal_mega.common.net import free_ports
from areal_mega.dataplane.control import ControlError, ControlServer, RolloutLink
from areal_mega.launch.plan import ServerSlot
from areal_mega.launch.supervisor import ProcessSpec

log = logging.getLogger(__name__)


class ScaleError(ValueError):
    """A scale request that cannot be applied; nothing was changed."""


def free_gpus(n_gpus: int, used: set, per_server: int, n_servers: int) -> list:
    """GPU tuples for ``n_servers`` new servers of ``per_server`` GPUs each among GPUs
    ``0..n_gpus-1`` minus ``used`` (pure); ``ScaleError`` when there are too few."""
    free = [g for g in range(n_gpus) if g not in used]
    need = per_server * n_servers
    if len(free) < need:
        raise ScaleError(f"{n_servers} server(s) x {per_server} GPU(s) need {need} free GPUs; "
                         f"{len(free)} free of cluster.n_gpus_per_node={n_gpus} "
                         f"(in use: {sorted(used)})")
    return [tuple(free[i * per_server:(i + 1) * per_server]) for i in range(n_servers)]


class ScaleService:
    """Membership of the run's rollout servers, owned by ``launch.local`` (module docstring).

    ``make_spec(slot) -> ProcessSpec`` builds a local server's spec (as at launch); ``members``
    are the servers at launch: ``{id: {"addr", "owned", "gpus"}}``; ``gpu_info`` is
    ``(n_gpus_per_node, gpus_per_server, trainer_gpus)`` on GPU, None on CPU."""

    def __init__(self, cfg, supervisor, paths, make_spec, members: dict, *,
                 host: str = "127.0.0.1", gpu_info: Optional[tuple] = None,
                 distributed_updates: bool = False):
        self.cfg, self.sup, self.paths = cfg, supervisor, paths
        self.make_spec = make_spec
        self.members = dict(members)
        self.host = host
        self.gpu_info = gpu_info
        self.distributed_updates = distributed_updates
        self._next = {"rollout": len([m for m in members if m.startswith("rollout")]),
                      "ext": len([m for m in members if m.startswith("ext")])}
        self._lock = threading.Lock()
        self._done: dict = {}                   # request_id -> answer (resent commands)
        self._save()
        self.link = RolloutLink(paths.control_endpoint, secret=cfg.dataplane.secret,
                                timeout_s=cfg.rollout.request_timeout_s)
        self.server = ControlServer(paths.launcher_endpoint, self.handle,
                                    secret=cfg.dataplane.secret).start()

    def _save(self) -> None:
        """Write the member addresses for a relaunched rollout worker (atomically; durable
        too, as it changes only when servers join or leave)."""
        atomic_write(self.paths.rollout_servers_file,
                     json.dumps({"addrs": [m["addr"] for m in self.members.values()],
                                 "ids": list(self.members)}), durable=True)

    def close(self) -> None:
        """Stop answering and close the sockets."""
        self.server.close()
        self.link.close()

    def _new_id(self, kind: str) -> str:
        while f"{kind}{self._next[kind]}" in self.members:
            self._next[kind] += 1
        sid = f"{kind}{self._next[kind]}"
        self._next[kind] += 1
        return sid

    def handle(self, msg: dict) -> dict:
        """Answer one command (see the module docstring); runs on the control thread. A
        command resent with the same ``request_id`` (the client saw the socket drop and sent it
        again) gets the first answer instead of running twice."""
        cmd = msg["cmd"]
        with self._lock:
            if cmd == "list":
                return self.list()
            rid = msg.get("request_id")
            if rid is not None and rid in self._done:
                return self._done[rid]
            out = self._apply(cmd, msg)
            if rid is not None:
                self._done[rid] = out
                while len(self._done) > 64:
                    self._done.pop(next(iter(self._done)))
            return out

    def _apply(self, cmd: str, msg: dict) -> dict:
        if cmd == "add":
            n = msg.get("n")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ScaleError(f"add: n={n!r}: must be an integer >= 1")
            return {"added": self._add_local(n)}
        if cmd == "add_addr":
            return {"added": [self._attach(str(msg.get("addr") or ""))]}
        if cmd == "remove":
            return self._remove(str(msg.get("id") or ""), bool(msg.get("drain", False)))
        raise ScaleError(f"unknown command {cmd!r}; expected list, add, add_addr or remove")

    def list(self) -> dict:
        """The members and (when the worker answers) its per-server counters."""
        try:
            pool = self.link.request({"cmd": "servers"}, timeout_s=30)
            pool.pop("ok", None)
        except Exception as e:  # noqa: BLE001 - listing still works without the worker
            pool = {"error": str(e)}
        return {"members": [{"id": k, **v} for k, v in self.members.items()], "pool": pool}

    def _add_local(self, n: int) -> list:
        """Start ``n`` servers together, wait until each answers, then have the worker join
        them one by one; a server that fails to come up or to join is stopped, the ones
        before it stay (each is reported)."""
        gpus: list = [()] * n
        if self.gpu_info is not None:
            n_gpus, per_server, trainer_gpus = self.gpu_info
            used = set(trainer_gpus) | {g for m in self.members.values() for g in m["gpus"]}
            gpus = free_gpus(n_gpus, used, per_server, n)
        ports = free_ports(n, self.host)
        started = []
        for g, port in zip(gpus, ports):
            sid = self._new_id("rollout")
            spec: ProcessSpec = self.make_spec(ServerSlot(int(sid[len("rollout"):]), 0, g, port))
            if spec.name != sid:
                raise RuntimeError(f"make_spec named the server {spec.name!r}, expected {sid!r}")
            started.append((sid, spec, g, port, self.sup.call(lambda s, sp=spec: s.add(sp))))
        added, error = [], None
        for sid, spec, g, port, run in started:
            if error is None:
                error = self._wait_ready(sid, spec, run)
            if error is None:
                addr = f"{self.host}:{port}"
                try:
                    joined = self._join(addr)
                except Exception as e:  # noqa: BLE001 - reported after the cleanup
                    error = e
                else:
                    self.members[sid] = {"addr": addr, "owned": True, "gpus": list(g)}
                    self._save()
                    self.sup.say(f"{sid} ({addr}) joined the rollout at version "
                                 f"{joined.get('version')}")
                    added.append({"id": sid, "addr": addr, "version": joined.get("version")})
                    continue
            self.sup.call(lambda s, name=sid: s.retire(name))
        if error is not None:
            done = f" (added: {', '.join(a['id'] for a in added)})" if added else ""
            raise ScaleError(f"add: {error}{done}")
        return added

    def _wait_ready(self, sid: str, spec: ProcessSpec, run) -> Optional[str]:
        """None once ``sid`` answers its readiness probe, else why it did not."""
        deadline = time.monotonic() + spec.ready_timeout_s
        while True:
            if run.proc.poll() is not None:
                return (f"{sid} exited (code {run.proc.returncode}) before it was ready; see "
                        f"{run.log.name}")
            try:
                if spec.ready():
                    return None
            except Exception:  # noqa: BLE001 - still booting
                pass
            if time.monotonic() > deadline:
                return f"{sid} not ready after {spec.ready_timeout_s:.0f}s; see {run.log.name}"
            time.sleep(0.2)

    def _attach(self, addr: str) -> dict:
        if any(m["addr"] == addr for m in self.members.values()):
            raise ScaleError(f"add_addr: {addr} is already a member")
        joined = self._join(addr)
        sid = self._new_id("ext")
        self.members[sid] = {"addr": addr, "owned": False, "gpus": []}
        self._save()
        self.sup.say(f"{sid} ({addr}, external) joined the rollout at version "
                     f"{joined.get('version')}")
        return {"id": sid, "addr": addr, "version": joined.get("version")}

    def _join(self, addr: str) -> dict:
        """Have the worker add ``addr``: at the current weights from disk, or (distributed
        weight updates) pending the trainer's next broadcast to a group that includes it."""
        return self.link.request({"cmd": "add_server", "addr": addr,
                                  "via_group": self.distributed_updates})

    def _remove(self, sid: str, drain: bool) -> dict:
        if sid not in self.members:
            raise ScaleError(f"remove: unknown server id {sid!r}; members: "
                             f"{', '.join(self.members) or 'none'}")
        m = self.members[sid]
        deadline = time.monotonic() + self.cfg.rollout.request_timeout_s
        while True:   # a broadcast in progress holds the server in its group: wait for it
            try:
                out = self.link.request({"cmd": "remove_server", "addr": m["addr"],
                                         "drain": drain})
                break
            except ControlError as e:
                if "broadcast is in progress" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        del self.members[sid]
        self._save()
        if m["owned"]:
            self.sup.call(lambda s: s.retire(sid))
        how = "drained" if drain else "its requests resume elsewhere"
        self.sup.say(f"{sid} ({m['addr']}) left the rollout ({how}; "
                     f"{out.get('aborted', 0)} interrupted)")
        return {"id": sid, **out}


def start_scale_service(cfg, supervisor, paths, layout, make_spec, *, host: str = "127.0.0.1",
                        distributed_updates: bool = False) -> ScaleService:
    """The :class:`ScaleService` of a run that ``launch.local`` started with ``layout``: its
    members are the external ``rollout.server_addrs`` (``ext<k>``) and the launched servers
    (``rollout<k>``, the supervisor's process names)."""
    members = {f"ext{i}": {"addr": a, "owned": False, "gpus": []}
               for i, a in enumerate(cfg.rollout.server_addrs)}
    for slot in layout.servers:
        members[f"rollout{slot.index}"] = {"addr": f"{host}:{slot.port}", "owned": True,
                                           "gpus": list(slot.gpus or ())}
    a = layout.allocation
    gpu_info = None
    if layout.device != "cpu" and a.rollout is not None:
        gpu_info = (cfg.cluster.n_gpus_per_node, a.rollout.tp * a.rollout.pp,
                    tuple(layout.trainer_gpus))
    return ScaleService(cfg, supervisor, paths, make_spec, members, host=host,
                        gpu_info=gpu_info, distributed_updates=distributed_updates)

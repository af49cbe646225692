"""Placement of rollout servers and trainer ranks on nodes and GPUs (pure functions).

Rules (GPU clusters):

- a rollout server uses ``t·p`` GPUs of the rollout part and never spans nodes; there are ``d``
  servers. They are packed onto nodes from node 0. With ``rollout.server_addrs`` set, none are
  launched (the trainer joins external servers) and the rollout part takes no GPUs.
- the trainer's world (``d·t·p·c``) starts on the GPUs left on the last rollout node when the
  whole job fits on one node; otherwise it takes whole nodes after the rollout nodes
  (``nproc_per_node = gpus_per_node``), so torchrun sees a uniform layout.
- tensor parallelism stays within a node (``t <= gpus_per_node``).

On CPU (``cluster.device=cpu``) everything runs on node 0 as processes; GPU ids are empty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from areal_mega.config import ConfigError
from areal_mega.parallel.allocation import Allocation


@dataclass(frozen=True)
class ServerSlot:
    """One rollout server: where it runs and which GPUs it owns."""

    index: int
    node: int
    gpus: tuple
    port: Optional[int] = None


@dataclass
class Layout:
    allocation: Allocation
    device: str
    n_nodes: int
    gpus_per_node: int
    servers: list = field(default_factory=list)  # ServerSlot
    external_servers: list = field(default_factory=list)  # host:port strings
    trainer_nodes: list = field(default_factory=list)  # node indices
    trainer_nproc_per_node: int = 1
    trainer_gpus: tuple = ()  # GPU ids on each trainer node
    notes: list = field(default_factory=list)

    @property
    def rollout_world_size(self) -> int:
        return sum(len(s.gpus) or 1 for s in self.servers)

    @property
    def trainer_world_size(self) -> int:
        return self.allocation.trainer_world_size

    def ranks_per_node(self) -> dict:
        """``{node: {"rollout": [server indices], "trainer": [global ranks]}}``."""
        out: dict = {}
        for s in self.servers:
            out.setdefault(s.node, {"rollout": [], "trainer": []})["rollout"].append(s.index)
        for i, node in enumerate(self.trainer_nodes):
            start = i * self.trainer_nproc_per_node
            out.setdefault(node, {"rollout": [], "trainer": []})["trainer"] = list(
                range(start, start + self.trainer_nproc_per_node)
            )
        return dict(sorted(out.items()))

    def describe(self) -> str:
        a = self.allocation
        lines = [
            f"  allocation: {a.rollout_backend or 'external'}:"
            f"{a.rollout.short() if a.rollout else '-'} + {a.trainer_backend}:"
            f"{a.trainer.short()}  (device {self.device}, "
            + (
                "processes on this machine)"
                if self.device == "cpu"
                else f"{self.n_nodes} node(s) x {self.gpus_per_node} GPU(s))"
            )
        ]
        if self.external_servers:
            lines.append(f"  rollout: external servers {', '.join(self.external_servers)}")
        else:
            per = (a.rollout.tp * a.rollout.pp) if a.rollout else 0
            each = "1 process" if self.device == "cpu" else f"{per} GPU(s)"
            lines.append(
                f"  rollout: {len(self.servers)} {a.rollout_backend} server(s) x "
                f"{each} (tp={a.rollout.tp if a.rollout else '-'}); world "
                f"{self.rollout_world_size}"
            )
        t = a.trainer
        lines.append(
            f"  trainer: world {self.trainer_world_size} = dp {t.dp} x tp {t.tp} x "
            f"pp {t.pp} x cp {t.cp} (ep {t.ep}"
            + (f", expert tp {t.etp}" if t.etp is not None else "")
            + "); torchrun --nnodes "
            f"{len(self.trainer_nodes)} --nproc-per-node {self.trainer_nproc_per_node}"
        )
        for node, roles in self.ranks_per_node().items():
            parts = []
            for s in (x for x in self.servers if x.node == node):
                gpus = f" gpus {list(s.gpus)}" if s.gpus else ""
                parts.append(f"server {s.index}{gpus}")
            if roles["trainer"]:
                r = roles["trainer"]
                gpus = f" gpus {list(self.trainer_gpus)}" if self.trainer_gpus else ""
                parts.append(f"trainer ranks {r[0]}-{r[-1]}{gpus}")
            lines.append(f"  node {node}: " + "; ".join(parts))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_layout(
    alloc: Allocation,
    *,
    device: str = "cuda",
    n_nodes: int = 1,
    gpus_per_node: int = 8,
    external_servers: Optional[list] = None,
    ports: Optional[list] = None,
) -> Layout:
    """Place servers and trainer ranks; raises :class:`ConfigError` naming the key at fault."""
    external = list(external_servers or [])
    lay = Layout(alloc, device, n_nodes, gpus_per_node, external_servers=external)
    n_servers = 0 if external or alloc.rollout is None else alloc.rollout.dp
    if alloc.rollout is None and not external:
        raise ConfigError(
            f"allocation={alloc.canonical()!r}: no rollout part; give one "
            "(e.g. sglang:d2+...) or external servers with rollout.server_addrs"
        )
    ports = list(ports or [])
    if device == "cpu":
        for i in range(n_servers):
            lay.servers.append(ServerSlot(i, 0, (), ports[i] if i < len(ports) else None))
        lay.trainer_nodes = [0]
        lay.trainer_nproc_per_node = alloc.trainer_world_size
        if n_nodes > 1:
            lay.notes.append("cluster.device=cpu runs every process on this machine (node 0)")
        return lay

    per_server = alloc.rollout.tp * alloc.rollout.pp if n_servers else 0
    if per_server > gpus_per_node:
        raise ConfigError(
            f"allocation={alloc.canonical()!r}: one rollout server needs "
            f"t·p = {per_server} GPUs but cluster.n_gpus_per_node="
            f"{gpus_per_node}; a server cannot span nodes"
        )
    if alloc.trainer.tp > gpus_per_node:
        raise ConfigError(
            f"allocation={alloc.canonical()!r}: trainer tensor parallel "
            f"t={alloc.trainer.tp} exceeds cluster.n_gpus_per_node={gpus_per_node}"
        )
    node, used = 0, 0
    for i in range(n_servers):
        if used + per_server > gpus_per_node:
            node, used = node + 1, 0
        lay.servers.append(
            ServerSlot(
                i, node, tuple(range(used, used + per_server)), ports[i] if i < len(ports) else None
            )
        )
        used += per_server
    world = alloc.trainer_world_size
    rollout_gpus = n_servers * per_server
    if rollout_gpus + world <= gpus_per_node:  # everything on one node
        start = used if n_servers else 0
        lay.trainer_nodes = [node if n_servers else 0]
        lay.trainer_nproc_per_node = world
        lay.trainer_gpus = tuple(range(start, start + world))
    else:
        first = node + 1 if n_servers else 0
        nproc = min(world, gpus_per_node)
        if world % nproc:
            raise ConfigError(
                f"allocation={alloc.canonical()!r}: the trainer world {world} "
                f"spans nodes, so it must be a multiple of "
                f"cluster.n_gpus_per_node={gpus_per_node}"
            )
        lay.trainer_nodes = list(range(first, first + world // nproc))
        lay.trainer_nproc_per_node = nproc
        lay.trainer_gpus = tuple(range(nproc))
        if n_servers and used < gpus_per_node:
            lay.notes.append(
                f"node {node}: {gpus_per_node - used} GPU(s) idle (the trainer takes whole nodes)"
            )
    needed = max([s.node for s in lay.servers] + lay.trainer_nodes) + 1
    if needed > n_nodes:
        raise ConfigError(
            f"cluster.n_nodes={n_nodes}: the allocation {alloc.canonical()!r} "
            f"needs {needed} node(s) of {gpus_per_node} GPUs ({rollout_gpus} "
            f"rollout + {world} trainer GPUs)"
        )
    if needed < n_nodes:
        lay.notes.append(f"{n_nodes - needed} node(s) unused by this allocation")
    return lay


def assign_ports(n: int, base: int, taken: Optional[set] = None) -> list:
    """``n`` ports counting up from ``base``, skipping ``taken`` (pure; for planned clusters)."""
    taken = set(taken or ())
    out, p = [], base
    while len(out) < n:
        if p > 65535:
            raise ConfigError(f"port base {base}: not enough ports below 65536")
        if p not in taken:
            out.append(p)
        p += 1
    return out


def gpus_needed(alloc: Allocation, external: bool = False) -> int:
    """Total GPUs of an allocation (rollout part not counted for external servers)."""
    r = 0 if external or alloc.rollout is None else alloc.rollout_world_size
    return r + alloc.trainer_world_size


def nodes_needed(alloc: Allocation, gpus_per_node: int) -> int:
    return math.ceil(gpus_needed(alloc) / gpus_per_node)

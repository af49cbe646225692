"""Placement of a run's processes in Ray placement groups, and on a cluster's nodes (pure).

``launch.ray`` reserves one placement group per rollout server (a server never spans nodes, and
``launch.scale`` adds and removes them one at a time) and one for the trainer: a bundle per
trainer node (``nproc_per_node`` GPUs each, ``STRICT_SPREAD`` over nodes when there are
several, as torchrun expects one agent per node). The rollout worker shares the trainer's first
bundle: its sockets to the trainer are ``ipc://`` paths in the run directory, so it runs on
rank 0's node; it waits on the servers and reserves no CPU of its own by default (a slot with
no resources rides on its bundle's). On CPU (``cluster.device=cpu``) the bundles ask for CPUs only.

:func:`assign_nodes` simulates Ray's placement on a list of nodes (first fit, largest bundle
first): the ``--dry-run`` report names the node of each process, and a cluster that cannot
hold the allocation gets one message naming what it needs and what each node has
(:class:`PlacementShortage`). Plain data in, plain data out: no ray import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_mega.launch.plan import Layout

WORKER = "rollout_worker"
TRAINER = "trainer"


@dataclass(frozen=True)
class Slot:
    """One process in a bundle, with the resources its launcher actor holds."""

    process: str
    resources: tuple  # sorted ((name, amount), ...)

    @property
    def demand(self) -> dict:
        return dict(self.resources)


@dataclass(frozen=True)
class Bundle:
    slots: tuple  # Slot

    @property
    def resources(self) -> dict:
        """What Ray reserves for the bundle: the sum of its slots' resources."""
        out: dict = {}
        for s in self.slots:
            for k, v in s.resources:
                out[k] = out.get(k, 0) + v
        return {k: v for k, v in sorted(out.items()) if v}


@dataclass(frozen=True)
class Group:
    """One placement group: a name (``<run>-<process>``), its bundles, its strategy."""

    name: str
    bundles: tuple  # Bundle
    strategy: str


@dataclass
class Placement:
    groups: list  # Group

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def processes(self) -> list:
        """``[(process, group name, bundle index, resources)]`` in start order (servers,
        worker, trainer nodes)."""
        out = []
        for g in self.groups:
            for i, b in enumerate(g.bundles):
                for s in b.slots:
                    out.append((s.process, g.name, i, s.demand))
        return out

    def total(self) -> dict:
        """Resources of the whole allocation."""
        out: dict = {}
        for g in self.groups:
            for b in g.bundles:
                for k, v in b.resources.items():
                    out[k] = out.get(k, 0) + v
        return dict(sorted(out.items()))


class PlacementShortage(ValueError):
    """The cluster cannot hold the allocation; the message names both sides."""


def _res(**kw) -> tuple:
    return tuple(sorted((k, v) for k, v in kw.items() if v))


def ray_options(resources: dict) -> dict:
    """The actor options that hold ``resources`` of a bundle: ``num_cpus``, ``num_gpus`` and
    the custom ``resources`` (an actor without any still needs ``num_cpus=0`` said)."""
    res = dict(resources)
    return {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0), "resources": res}


def trainer_process(node_rank: int, n_nodes: int) -> str:
    """The process name of the trainer's agent on trainer node ``node_rank``: ``trainer`` on a
    single node (as under ``launch.local``), ``trainer@<k>`` across several."""
    return TRAINER if n_nodes == 1 else f"{TRAINER}@{node_rank}"


def server_group(
    run: str, index: int, gpus_per_server: int, cpus_per_server: int, device: str
) -> Group:
    """The placement group of rollout server ``index`` (also for one ``launch.scale`` adds)."""
    gpus = gpus_per_server if device != "cpu" else 0
    slot = Slot(f"rollout{index}", _res(CPU=cpus_per_server, GPU=gpus))
    return Group(f"{run}-rollout{index}", (Bundle((slot,)),), "STRICT_PACK")


def plan_placement(
    layout: Layout,
    *,
    run: str,
    rl: bool = True,
    cpus_per_server: int = 1,
    cpus_per_trainer_rank: int = 1,
    worker_cpus: float = 0,
) -> Placement:
    """The placement groups of ``layout``'s processes (servers launched by the run only)."""
    a = layout.allocation
    cpu = layout.device == "cpu"
    groups = []
    per_server = a.rollout.tp * a.rollout.pp if a.rollout is not None else 0
    for s in layout.servers:
        groups.append(server_group(run, s.index, per_server, cpus_per_server, layout.device))
    n_nodes = len(layout.trainer_nodes)
    nproc = layout.trainer_nproc_per_node
    bundles = []
    for k in range(n_nodes):
        slots = [
            Slot(
                trainer_process(k, n_nodes),
                _res(CPU=cpus_per_trainer_rank * nproc, GPU=0 if cpu else nproc),
            )
        ]
        if k == 0 and rl:
            slots.append(Slot(WORKER, _res(CPU=worker_cpus)))  # may be empty (see above)
        bundles.append(Bundle(tuple(slots)))
    strategy = "STRICT_SPREAD" if n_nodes > 1 else "STRICT_PACK"
    groups.append(Group(f"{run}-{TRAINER}", tuple(bundles), strategy))
    return Placement(groups)


def _fmt(res: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(res.items())) or "nothing"


def _fits(need: dict, free: dict) -> bool:
    return all(free.get(k, 0) >= v for k, v in need.items())


def assign_nodes(placement: Placement, nodes: list) -> dict:
    """``{(group name, bundle index): node name}`` for ``nodes`` = ``[(name, {resource:
    amount})]`` (the resources free for this run): first fit, the largest bundles first, a
    ``STRICT_SPREAD`` group's bundles on distinct nodes, a ``STRICT_PACK`` group's on one.
    Raises :class:`PlacementShortage` naming what the allocation needs and what the nodes have.
    """
    free = {name: dict(res) for name, res in nodes}
    order = sorted(
        placement.groups,
        key=lambda g: (-max(b.resources.get("GPU", 0) for b in g.bundles), -len(g.bundles)),
    )
    out: dict = {}
    for g in order:
        taken: set = set()
        for i, b in sorted(enumerate(g.bundles), key=lambda ib: -sum(ib[1].resources.values())):
            need = b.resources
            where = None
            for name, _ in nodes:
                if g.strategy == "STRICT_SPREAD" and name in taken:
                    continue
                if g.strategy == "STRICT_PACK" and taken and name not in taken:
                    continue
                if _fits(need, free[name]):
                    where = name
                    break
            if where is None:
                raise PlacementShortage(shortage_message(placement, nodes, g.name, i))
            for k, v in need.items():
                free[where][k] = free[where].get(k, 0) - v
            taken.add(where)
            out[(g.name, i)] = where
    return out


def shortage_message(
    placement: Placement, nodes: list, group: Optional[str] = None, bundle: Optional[int] = None
) -> str:
    """What the allocation needs (in total and its largest bundle) and what the cluster has."""
    largest = max(
        (b.resources for g in placement.groups for b in g.bundles),
        key=lambda r: (r.get("GPU", 0), sum(r.values())),
    )
    have: dict = {}
    for _, res in nodes:
        for k, v in res.items():
            have[k] = have.get(k, 0) + v
    lines = [
        "the cluster cannot hold this allocation: it needs "
        f"{_fmt(placement.total())} in {sum(len(g.bundles) for g in placement.groups)} "
        f"bundle(s) (the largest {{{_fmt(largest)}}}, on one node)"
        + (f"; bundle {bundle} of {group} does not fit" if group is not None else ""),
        f"the cluster has {_fmt(have)} on {len(nodes)} node(s): "
        + "; ".join(f"{name}: {_fmt(res)}" for name, res in nodes),
    ]
    return "\n".join(lines)


def describe_placement(placement: Placement, where: Optional[dict] = None) -> str:
    """One line per process: its group, bundle, resources and (when assigned) node."""
    lines = [
        f"placement ({len(placement.groups)} placement group(s), total {_fmt(placement.total())}):"
    ]
    for process, group, i, res in placement.processes():
        node = f" on {where[(group, i)]}" if where else ""
        lines.append(f"  {process}: {group} bundle {i} {{{_fmt(res)}}}{node}")
    return "\n".join(lines)

"""Ray launcher: the processes of ``launch.local``, placed and started on a Ray cluster.

    ray start --head                          # on the first node (``ray start --address`` others)
    python -m areal_mega.launch.ray --config recipes/tiny-cpu.yaml [key=value ...] [--dry-run]
    ray job submit -- python -m areal_mega.launch.ray --config ...

Ray only places and starts processes; it is not in the data path. The launcher connects to the
running cluster (``RAY_ADDRESS``, else the local ``ray start`` one), reserves the placement
groups :mod:`areal_mega.launch.ray_placement` plans (one per rollout server; one for the
trainer, a bundle per trainer node, the rollout worker in the first), waits for them at most
``--placement-timeout`` seconds (then one message: what the allocation needs, what the cluster
has), and starts one small actor (:class:`ProcessHost`) per process in its bundle. Each actor
starts its process as a child with exactly the command line and environment ``launch.local``
uses (HTTP to the servers, ZMQ between worker and trainer, torch.distributed in the trainer),
``CUDA_VISIBLE_DEVICES`` from Ray's GPU assignment, and reports its exit. The driver supervises
them with :class:`~areal_mega.launch.supervisor.Supervisor` as ``launch.local`` does: a dead
server or rollout worker is started again in its bundle, a dead trainer with ``recover=auto``
resumes from its latest checkpoint; a process whose node is lost is started again when Ray has
placed its bundle elsewhere, or the run stops naming the checkpoint to resume from.

The run directory must be on storage every node sees: each actor reads a token the driver
wrote there before anything starts. Servers bind their node's address, so (as with
``launch.local --serve-node``) ``rollout.api_key`` is required unless every node is loopback or
``rollout.allow_unauthenticated=true``. ``--dry-run`` prints the layout, the memory arithmetic
and the placement (each process's group, bundle and node; the nodes of the cluster when one is
reachable, else ``cluster.n_nodes`` planned ones).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "areal_mega.launch.ray needs Ray, an optional extra: pip install -e .[ray]"
    ) from None

from areal_mega.common.net import free_ports, is_loopback_host
from areal_mega.config import ConfigError, ExperimentConfig, check_against_model, load_config
from areal_mega.launch.elastic import start_scale_service
from areal_mega.launch.local import (
    TRAINER_MODULE,
    describe,
    make_layout,
    resolve_device,
    restartable_rollout,
    resume_point,
    server_spec,
    trainer_command,
    trainer_spec,
    weight_group,
    worker_spec,
    write_run_config,
)
from areal_mega.launch.plan import ServerSlot
from areal_mega.launch.ray_placement import (
    WORKER,
    Placement,
    PlacementShortage,
    assign_nodes,
    describe_placement,
    plan_placement,
    ray_options,
    server_group,
    shortage_message,
)
from areal_mega.launch.server_commands import check_server_runtime, server_secrets
from areal_mega.launch.supervisor import RemoteProcess, Supervisor, start_child, stop_tree
from areal_mega.run_dir import RunDir
from areal_mega.security import check_bind

SHARED_CHECK_FILE = ".ray_shared_check"
"""The token file in the run directory each node's actor must read back."""
_GCS: dict = {"address": None}  # host:port of the cluster's GCS, once connected


def cluster_gone() -> Optional[str]:
    """Why the cluster is gone (its GCS refuses connections: ``ray stop``, the head lost), or
    None. A TCP connect, bounded: asking Ray itself blocks while its GCS is away."""
    addr = _GCS["address"]
    if not addr:
        return None
    host, port = addr.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return None
    except OSError as e:
        return f"the Ray cluster is gone (its GCS at {addr}: {e.strerror or e}; ray stop?)"


# ----------------------------------------------------------------------------- the actor


class ProcessHost:
    """A Ray actor in one placement-group bundle: starts one process of the run as its child
    (:func:`~areal_mega.launch.supervisor.start_child`, from a thread that lives as long as
    the child, so the child dies with the actor), waits for it, stops it on request."""

    def __init__(self):
        self._proc = None
        self._rc: Optional[int] = None
        self._done = threading.Event()

    def info(self) -> dict:
        """Where it runs: node address and id, host name, the GPU ids Ray assigned it."""
        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "hostname": socket.gethostname(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def pick_port(self, host: str) -> int:
        return free_ports(1, host)[0]

    def read(self, path: str) -> Optional[str]:
        """The text of ``path`` as this node sees it (None when it cannot read it)."""
        try:
            return Path(path).read_text()
        except OSError:
            return None

    def start(
        self, argv: list, env: dict, cwd: Optional[str], log_path: str, grace_s: float = 10.0
    ) -> int:
        """Start the process (``env`` added to this node's environment; the GPUs Ray assigned
        this actor, if any, as ``CUDA_VISIBLE_DEVICES``) and its :mod:`reaper
        <areal_mega.launch.reaper>` (which stops the whole tree, ``grace_s`` after SIGTERM,
        should this actor die with its node); returns its pid."""
        full = dict(os.environ)
        full.update(env)
        gpus = ray.get_gpu_ids()
        if gpus:
            full["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        self._rc, started = None, threading.Event()
        self._done.clear()
        error: list = []

        def run() -> None:
            try:
                with open(log_path, "ab") as log:
                    self._proc = start_child(argv, full, cwd, log)
                # detached: Ray kills this worker's own children when it exits
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "areal_mega.launch.reaper",
                        "--detach",
                        str(os.getpid()),
                        str(self._proc.pid),
                        str(grace_s),
                    ],
                    env=full,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                    check=True,
                    timeout=120,
                )
            except (OSError, subprocess.SubprocessError) as e:
                if self._proc is not None and self._proc.poll() is None:
                    stop_tree(self._proc, grace_s)  # not without its reaper
                error.append(e)
                started.set()
                self._rc = 127
                self._done.set()
                return
            started.set()
            self._rc = self._proc.wait()
            self._done.set()

        threading.Thread(target=run, daemon=True, name="child").start()
        started.wait()
        if error:
            raise RuntimeError(f"cannot start {argv[:3]}: {error[0]}")
        return self._proc.pid

    def wait(self) -> int:
        """Block until the process has exited; its return code (negative: a signal)."""
        self._done.wait()
        return self._rc

    def terminate(self, grace_s: float) -> None:
        """Stop the process tree (SIGTERM, SIGKILL after ``grace_s``)."""
        if self._proc is not None and self._proc.poll() is None:
            stop_tree(self._proc, grace_s)


# ----------------------------------------------------------------------------- driver side


class RayProcess(RemoteProcess):
    """A process started by a :class:`ProcessHost` actor, as the supervisor sees it."""

    def __init__(self, actor, pid: int, where: str):
        self.actor, self.pid, self.where = actor, pid, where
        self._ref = actor.wait.remote()

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        ready, _ = ray.wait([self._ref], timeout=0)
        if not ready:
            return None
        try:
            self.returncode = ray.get(self._ref)
        except ray.exceptions.ActorUnavailableError:
            # unreachable for now (e.g. its node is being declared dead): ask again; a dead
            # actor answers ActorDiedError, a reachable one goes on waiting for its child
            self._ref = self.actor.wait.remote()
            return None
        except ray.exceptions.RayError as e:
            # the actor is gone (its node lost, or Ray stopped); its child died with it
            self.lost = cluster_gone() or (
                f"its Ray actor on {self.where} died ({type(e).__name__})"
            )
            self.returncode = -9
        return self.returncode

    def terminate(self, grace_s: float) -> None:
        try:
            self.actor.terminate.remote(grace_s)
        except ray.exceptions.RayError:
            pass

    def kill(self) -> None:
        try:
            ray.kill(self.actor)
        except ray.exceptions.RayError:
            pass


class BundleLauncher:
    """The :attr:`ProcessSpec.launcher` of one process: a :class:`ProcessHost` actor in the
    process's bundle, holding the bundle resources of its slot; a new actor when the last one
    died (its node lost: Ray places the bundle again, within ``timeout_s``)."""

    def __init__(
        self,
        process: str,
        pg,
        bundle: int,
        resources: dict,
        timeout_s: float,
        grace_s: float = 10.0,
    ):
        self.process, self.pg, self.bundle = process, pg, bundle
        self.resources, self.timeout_s, self.grace_s = dict(resources), timeout_s, grace_s
        self.actor, self.info = None, None

    def ensure(self) -> dict:
        """A live actor (started when needed); its :meth:`ProcessHost.info`."""
        gone = cluster_gone()
        if gone:
            raise RuntimeError(gone)
        if self.actor is not None:
            try:
                self.info = ray.get(self.actor.info.remote(), timeout=30)
                return self.info
            except ray.exceptions.RayError:
                self.actor = None
        deadline = time.monotonic() + self.timeout_s
        actor = self._new_actor()
        ref = actor.info.remote()
        while True:
            gone = cluster_gone()
            if gone:
                raise RuntimeError(gone)
            try:
                self.info = ray.get(ref, timeout=2.0)
                break
            except ray.exceptions.GetTimeoutError:
                if time.monotonic() > deadline:
                    ray.kill(actor)
                    raise RuntimeError(
                        f"no node could host {self.process} (bundle {self.bundle} "
                        f"{self.resources}) within {self.timeout_s:.0f}s"
                    ) from None
            except ray.exceptions.RayActorError:
                # placed on a node that was dying: Ray places the bundle again; a new actor
                if time.monotonic() > deadline:
                    raise
                actor = self._new_actor()
                ref = actor.info.remote()
        self.actor = actor
        return self.info

    def _new_actor(self):
        opts = ray_options(self.resources)
        return (
            ray.remote(ProcessHost)
            .options(
                num_cpus=opts["num_cpus"],
                num_gpus=opts["num_gpus"],
                resources=opts["resources"] or None,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=self.bundle
                ),
            )
            .remote()
        )

    def __call__(self, spec, argv: list, env: dict, log_path: Path, attempt: int) -> RayProcess:
        info = self.ensure()
        pid = ray.get(
            self.actor.start.remote(argv, env, spec.cwd, str(log_path), self.grace_s), timeout=60
        )
        return RayProcess(
            self.actor, pid, f"{info['hostname']} ({info['ip']}, node {info['node_id'][:8]})"
        )


def run_key(cfg: ExperimentConfig) -> str:
    """Placement-group names of this run: ``<name>-<hash of the run directory>``."""
    root = str(Path(cfg.logging.run_dir).resolve())
    return f"{cfg.name}-{hashlib.sha1(root.encode()).hexdigest()[:8]}"


def make_placement(cfg: ExperimentConfig, device: str) -> Placement:
    layout = make_layout(cfg, device)
    return plan_placement(
        layout,
        run=run_key(cfg),
        rl=cfg.mode == "rl",
        cpus_per_server=cfg.cluster.cpu_threads_per_server,
        cpus_per_trainer_rank=cfg.cluster.cpu_threads_per_trainer_rank or 1,
    )


def cluster_nodes(available: bool = True) -> list:
    """``[(name, resources)]`` of the live nodes (their free resources when ``available``,
    else their totals), for :func:`assign_nodes` and the shortage message."""
    out = []
    per_node = ray._private.state.available_resources_per_node() if available else {}
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = per_node.get(n["NodeID"], {}) if available else n["Resources"]
        keep = {k: v for k, v in res.items() if k in ("CPU", "GPU") or not _internal(k)}
        out.append((f"{n['NodeManagerAddress']}/{n['NodeID'][:8]}", keep))
    return out


def _internal(key: str) -> bool:
    return key.startswith(("node:", "memory", "object_store_memory", "accelerator_type")) or (
        "_group_" in key
    )


def connect() -> None:
    """Connect to the running cluster (``RAY_ADDRESS``, else the one ``ray start`` left on
    this machine); never start one."""
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ctx = ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        _GCS["address"] = ctx.address_info.get("gcs_address")
    except (ConnectionError, RuntimeError) as e:
        raise ConfigError(
            f"no Ray cluster at {address!r} ({e}); start one with `ray start --head` on the "
            "first node (and `ray start --address=HEAD:6379` on the others), or set "
            "RAY_ADDRESS"
        ) from None


def reserve(placement: Placement, timeout_s: float) -> dict:
    """Create the placement groups; wait at most ``timeout_s`` until all are placed (else
    remove them and raise :class:`PlacementShortage` with the cluster's resources)."""
    pgs = {
        g.name: placement_group([b.resources for b in g.bundles], strategy=g.strategy, name=g.name)
        for g in placement.groups
    }
    ready, _ = ray.wait(
        [pg.ready() for pg in pgs.values()], num_returns=len(pgs), timeout=timeout_s
    )
    if len(ready) < len(pgs):
        for pg in pgs.values():
            remove_placement_group(pg)
        raise PlacementShortage(
            f"placement groups not placed within {timeout_s:.0f}s (--placement-timeout)\n"
            + shortage_message(placement, cluster_nodes(available=False))
        )
    return pgs


def check_shared_run_dir(paths: RunDir, launchers: list) -> None:
    """Every node with a process of the run reads the token the driver wrote into the run
    directory; one ConfigError naming the nodes that cannot."""
    token = secrets.token_hex(8)
    f = paths.root / SHARED_CHECK_FILE
    f.write_text(token)
    bad = []
    for bl in launchers:
        if ray.get(bl.actor.read.remote(str(f)), timeout=60) != token:
            bad.append(f"{bl.info['hostname']} ({bl.info['ip']}, {bl.process})")
    f.unlink(missing_ok=True)
    if bad:
        raise ConfigError(
            f"the run directory {paths.root} is not on storage every node sees: "
            f"{', '.join(sorted(set(bad)))} cannot read what this node wrote there; put "
            "logging.run_dir (and checkpoint.dir) on a shared filesystem"
        )


def build_ray_specs(
    cfg: ExperimentConfig, device: str, placement: Placement, pgs: dict, timeout_s: float
) -> tuple:
    """Actors in every bundle, the shared-storage check, then the processes' specs (as
    ``launch.local`` builds them, each with its :class:`BundleLauncher`); ``(specs, layout,
    launchers)``."""
    layout = make_layout(cfg, device)
    paths = RunDir.from_config(cfg)
    paths.root.mkdir(parents=True, exist_ok=True)
    launchers = {}
    for process, group, i, res in placement.processes():
        launchers[process] = BundleLauncher(
            process, pgs[group], i, res, timeout_s, cfg.cluster.kill_grace_s
        )
        launchers[process].ensure()
    check_shared_run_dir(paths, list(launchers.values()))
    secret_env = server_secrets(cfg) if layout.servers else {}
    specs, addrs, slots = [], list(cfg.rollout.server_addrs), []
    for slot in layout.servers:
        bl = launchers[f"rollout{slot.index}"]
        host = bl.info["ip"]
        check_server_host(cfg, host)
        port = ray.get(bl.actor.pick_port.remote(host), timeout=60)
        slot = ServerSlot(slot.index, slot.node, slot.gpus, port)
        slots.append(slot)
        spec = server_spec(cfg, slot, host, cfg.mode == "rl", secret_env, device)
        spec.env.pop("CUDA_VISIBLE_DEVICES", None)  # the actor sets Ray's assignment
        spec.launcher = bl
        specs.append(spec)
        addrs.append(f"{host}:{port}")
    layout.servers = slots
    config_path = write_run_config(cfg, addrs)
    paths.fatal_file.unlink(missing_ok=True)  # a previous attempt's reason is not ours
    if cfg.mode == "rl":
        spec = worker_spec(cfg, config_path, restartable_rollout(cfg, layout))
        spec.launcher = launchers[WORKER]
        specs.append(spec)
    specs += trainer_specs(cfg, device, layout, config_path, placement, launchers)
    return specs, layout, launchers


def trainer_specs(cfg, device, layout, config_path, placement, launchers) -> list:
    """One torchrun agent per trainer bundle: ``--standalone`` on one node (as under
    ``launch.local``), else ``--nnodes N --node-rank k`` with the master address and a port
    of the first bundle's node."""
    nproc = layout.trainer_nproc_per_node
    names = [p for p, g, _, _ in placement.processes() if p.startswith("trainer")]
    env = {}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = str(cfg.cluster.cpu_threads_per_trainer_rank or 1)
    if len(names) == 1:
        if nproc == 1:  # no torchrun to hand it its node's address (the weight-update group's)
            env["MASTER_ADDR"] = launchers[names[0]].info["ip"]
        spec = trainer_spec(cfg, trainer_command(config_path, nproc), env)
        spec.launcher = launchers[names[0]]
        return [spec]
    first = launchers[names[0]]
    master = first.info["ip"]
    port = ray.get(first.actor.pick_port.remote(master), timeout=60)
    out = []
    for k, name in enumerate(names):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(names)),
            "--node-rank",
            str(k),
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            master,
            "--master-port",
            str(port),
            "-m",
            TRAINER_MODULE,
            "--config",
            str(config_path),
        ]
        spec = trainer_spec(cfg, argv, dict(env, MASTER_ADDR=master, MASTER_PORT=str(port)), name)
        spec.launcher = launchers[name]
        spec.gang = "trainer"  # torchrun's static rendezvous: every agent again, at once
        out.append(spec)
    return out


def check_server_host(cfg: ExperimentConfig, host: str) -> None:
    """Servers bind their node's address: refused without ``rollout.api_key`` off loopback."""
    if is_loopback_host(host):
        return
    check_bind(
        host,
        authenticated=bool(cfg.rollout.api_key),
        what="launch.ray rollout servers",
        fix="set rollout.api_key (without argv: AREAL_ROLLOUT_API_KEY_FILE=<a 0600 file>), "
        "or rollout.allow_unauthenticated=true on a trusted network",
        allow_unauthenticated=cfg.rollout.allow_unauthenticated,
    )


def dry_run(cfg: ExperimentConfig, device: str) -> str:
    """The ``--dry-run`` report: ``launch.local``'s (layout, memory arithmetic) and the
    placement, on the reachable cluster's nodes or on ``cluster.n_nodes`` planned ones."""
    out = [describe(cfg, device)]
    placement = make_placement(cfg, device)
    nodes, source = None, ""
    if os.environ.get("RAY_ADDRESS"):
        connect()
        nodes = cluster_nodes(available=True)
        source = f"the cluster at {os.environ['RAY_ADDRESS']} (free resources)"
        ray.shutdown()
    if nodes is None:
        # GPU nodes: their CPU count is unknown here, so CPUs are not what limits the plan
        cpus = (os.cpu_count() or 1) if device == "cpu" else placement.total().get("CPU", 0)
        res = {"CPU": cpus}
        if device != "cpu":
            res["GPU"] = cfg.cluster.n_gpus_per_node
        nodes = [(f"node{i}", dict(res)) for i in range(cfg.cluster.n_nodes)]
        source = (
            f"cluster.n_nodes={cfg.cluster.n_nodes} planned node(s) of {res} (set RAY_ADDRESS "
            "to place on a running cluster)"
        )
    try:
        where = assign_nodes(placement, nodes)
    except PlacementShortage as e:
        out += [describe_placement(placement), f"on {source}: {e}"]
        return "\n".join(out)
    out += [f"ray placement on {source}:", describe_placement(placement, where)]
    return "\n".join(out)


def release(pgs: dict, launchers: dict) -> None:
    """Kill the actors (their children die with them) and remove the placement groups."""
    for bl in launchers.values():
        if bl.actor is not None:
            try:
                ray.kill(bl.actor)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                pass
    for pg in pgs.values():
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass


def scaled_server_spec(
    cfg, device: str, slot, host: str, pgs: dict, launchers: dict, timeout_s: float
):
    """The spec of a server ``launch.scale --add`` starts: a placement group of its own, its
    bundle on this (the driver's) node, where the scale service picked its port."""
    a = make_layout(cfg, device).allocation
    g = server_group(
        run_key(cfg),
        slot.index,
        a.rollout.tp * a.rollout.pp,
        cfg.cluster.cpu_threads_per_server,
        device,
    )
    res = dict(g.bundles[0].resources, **{f"node:{host}": 0.001})
    pg = placement_group([res], strategy=g.strategy, name=g.name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"no room for {g.name} ({res}) on this node within {timeout_s:.0f}s\n"
            + shortage_message(Placement([g]), cluster_nodes(available=True))
        )
    name = f"rollout{slot.index}"
    pgs[g.name] = pg
    launchers[name] = BundleLauncher(name, pg, 0, res, timeout_s, cfg.cluster.kill_grace_s)
    launchers[name].ensure()
    spec = server_spec(cfg, slot, host, True, server_secrets(cfg), device)
    spec.env.pop("CUDA_VISIBLE_DEVICES", None)  # the actor sets Ray's assignment
    spec.launcher = launchers[name]
    return spec


def end_message(cfg: ExperimentConfig, why: str) -> str:
    """The last line of a run that did not finish: why, and where the same command resumes."""
    latest = resume_point(cfg) or RunDir.from_config(cfg).latest_checkpoint()
    where = f"it continues from {latest}" if latest else "no complete checkpoint yet"
    return (
        f"[launch] {why}; every process of the run is stopped. Resume with the same command "
        f"(recover=auto): {where}"
    )


def watch_cluster(cfg: ExperimentConfig, sup: Supervisor, period_s: float = 2.0) -> None:
    """Off the supervisor's loop (which may be inside a Ray call that blocks while the GCS is
    away, until Ray ends the process after a minute): once the GCS has refused two checks in
    a row, the cluster is gone (``ray stop``, the head lost) and with it every actor and the
    processes they started; say so and exit (1)."""

    def loop() -> None:
        misses = 0
        while True:
            time.sleep(period_s)
            gone = cluster_gone()
            misses = misses + 1 if gone else 0
            if misses >= 2:
                sup.say(f"{gone}: its nodes took the run's processes with them")
                print(end_message(cfg, gone), file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=loop, daemon=True, name="cluster-watch").start()


def wait_nodes(n: int, timeout_s: float) -> int:
    """Wait until the connected cluster has ``n`` live nodes (0), or say how many it has after
    ``timeout_s`` (2)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = sum(1 for x in ray.nodes() if x.get("Alive"))
        if alive >= n:
            print(f"[launch] the Ray cluster has {alive} node(s)", file=sys.stderr, flush=True)
            ray.shutdown()
            return 0
        if time.monotonic() > deadline:
            print(
                f"launch error: the Ray cluster has {alive} of {n} node(s) after {timeout_s:.0f}s",
                file=sys.stderr,
            )
            ray.shutdown()
            return 2
        time.sleep(1.0)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m areal_mega.launch.ray", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--config", required=True, help="recipe YAML (recipes/*.yaml)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the layout, the memory estimate and the placement; start nothing",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="plan for this device instead of cluster.device",
    )
    p.add_argument(
        "--placement-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="how long to wait for the cluster to place the allocation",
    )
    p.add_argument(
        "--wait-nodes",
        type=int,
        default=None,
        metavar="N",
        help="wait (at most --placement-timeout) until the cluster has N live nodes, "
        "then exit (launch/slurm/ray.sbatch)",
    )
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    if args.wait_nodes is not None:
        try:
            connect()
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        return wait_nodes(args.wait_nodes, args.placement_timeout)
    pgs, launchers = {}, {}
    try:
        cfg = load_config(args.config, args.overrides)
        check_against_model(cfg)
        device = args.device or resolve_device(cfg)
        if args.dry_run:
            print(dry_run(cfg, device))
            return 0
        try:
            RunDir.from_config(cfg).check_fresh_start(cfg.recover)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.rollout.server_addrs:
            raise ConfigError(
                "launch.ray launches its own rollout servers; for external "
                "ones (rollout.server_addrs) use launch.local"
            )
        checked = check_server_runtime(cfg)
        if checked:
            print(f"[launch] {checked}", file=sys.stderr, flush=True)
        placement = make_placement(cfg, device)
        connect()
        pgs = reserve(placement, args.placement_timeout)
        specs, layout, launchers = build_ray_specs(
            cfg, device, placement, pgs, args.placement_timeout
        )
    except (ConfigError, PlacementShortage, RuntimeError, ray.exceptions.RayError) as e:
        release(pgs, launchers)
        print(f"{'config' if isinstance(e, ConfigError) else 'launch'} error: {e}", file=sys.stderr)
        return 2
    where = {
        (g, i): launchers[p].info["hostname"] + "/" + launchers[p].info["node_id"][:8]
        for p, g, i, _ in placement.processes()
    }
    print(
        layout.describe() + "\n" + describe_placement(placement, where), file=sys.stderr, flush=True
    )
    sup = Supervisor(
        specs,
        RunDir.from_config(cfg).logs,
        grace_s=cfg.cluster.kill_grace_s,
        max_restarts=cfg.cluster.max_restarts,
    )
    scale = None
    if cfg.mode == "rl":  # launch.scale adds / removes servers while the job runs
        host = ray.util.get_node_ip_address()
        scale = start_scale_service(
            cfg,
            sup,
            RunDir.from_config(cfg),
            layout,
            distributed_updates=weight_group(cfg, layout) is not None,
            make_spec=lambda slot: scaled_server_spec(
                cfg, device, slot, host, pgs, launchers, args.placement_timeout
            ),
            host=host,
            addrs={
                s.index: f"{launchers[f'rollout{s.index}'].info['ip']}:{s.port}"
                for s in layout.servers
            },
            gpus=False,
        )
    watch_cluster(cfg, sup)
    rc = 1
    try:
        rc = sup.run()
    finally:
        if scale is not None:
            scale.close()
        gone = cluster_gone()
        if not gone:
            release(pgs, launchers)
        if rc != 0:
            print(end_message(cfg, gone or "the run failed"), file=sys.stderr, flush=True)
        if not gone:
            ray.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())

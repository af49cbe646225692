"""Single-machine launcher: rollout servers + trainer (torchrun for several ranks), supervised.

    python -m areal_mega.launch.local --config recipes/tiny-cpu.yaml [key=value ...] [--dry-run]

``--dry-run`` loads and validates the config, then prints the resolved layout (allocation,
rollout / trainer world sizes, ranks per node) and the per-GPU memory estimate; nothing starts.

Without it: writes the resolved config to ``<run_dir>/config.yaml``, starts the rollout servers
(``local`` backend: our CPU server; ``sglang``; ``vllm``, run by its own interpreter, checked
first: :mod:`areal_mega.launch.server_commands`) on free ports, waits until they answer, then
starts ``python -m torch.distributed.run ... -m TRAINER_MODULE --config
<run_dir>/config.yaml`` (one rank: ``python -m TRAINER_MODULE ...`` alone) with
``rollout.server_addrs`` filled in, and (RL mode) the rollout
worker (:data:`ROLLOUT_WORKER_MODULE`) that drives the servers and feeds the trainer. It
watches all; Ctrl-C / SIGTERM or the death of any one stops all (process groups, SIGTERM,
SIGKILL after ``cluster.kill_grace_s``). Logs go to ``<run_dir>/logs/<name>.log``. With
``recover=auto`` a crashed trainer is relaunched (at most ``cluster.max_restarts`` times); it
resumes from the latest complete checkpoint. A killed rollout server is relaunched alone,
whatever ``recover`` says (same budget; with distributed weight updates it rejoins the
trainer's group at the next update); a killed rollout worker too with disk weight updates (see
``docs/reliability.md``). A trainer that cannot save a checkpoint for want of disk space ends
the run (no relaunch). With ``rollout.server_addrs`` set no servers are launched: the trainer
joins the external ones. While the run goes on, ``python -m areal_mega.launch.scale`` adds and
removes rollout servers through this launcher (:mod:`areal_mega.launch.elastic`); the servers
it starts are its own. Multi-node runs use ``launch/slurm/`` or ``launch/torchrun.sh``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Optional

import yaml

from areal_mega.common.net import free_ports, http_ready
from areal_mega.config import (
    PRESETS,
    ConfigError,
    ExperimentConfig,
    check_against_model,
    config_to_dict,
    load_config,
)
from areal_mega.launch.elastic import start_scale_service
from areal_mega.launch.memory import (
    DEFAULT_OVERHEAD_BYTES,
    estimate_memory,
    lora_estimate_args,
    resolve_hparams,
    rollout_memory,
)
from areal_mega.launch.plan import Layout, plan_layout
from areal_mega.launch.server_commands import (
    backend_env,  # noqa: F401
    check_server_runtime,
    describe_servers,
    memory_fraction,
    server_command,
    server_secrets,
)
from areal_mega.launch.supervisor import ProcessSpec, Supervisor
from areal_mega.parallel.allocation import parse_allocation
from areal_mega.parallel.weight_group import WeightGroup, weight_update_group
from areal_mega.run_dir import FATAL_EXIT_CODE, LOW_SPACE_BYTES, RunDir, free_bytes
from areal_mega.security import API_KEY_FILE_ENV, check_bind, holds_secret, write_run_file
from areal_mega.train.weights import resolve_weight_update

# The one place that names the trainer entry point (``python -m <TRAINER_MODULE> --config F``).
# ``AREAL_MEGA_TRAINER_MODULE`` in the environment replaces it (custom trainers, tests).
TRAINER_MODULE = os.environ.get("AREAL_MEGA_TRAINER_MODULE", "areal_mega.trainer")
# The rollout worker (prompts -> servers -> rewards -> trajectories to the trainer; weight
# updates over the control socket): ``python -m <module> --config <run_dir>/config.yaml``.
# Started in RL mode. ``AREAL_MEGA_ROLLOUT_WORKER_MODULE`` replaces it (tests).
ROLLOUT_WORKER_MODULE = os.environ.get(
    "AREAL_MEGA_ROLLOUT_WORKER_MODULE", "areal_mega.rollout.worker"
)
# Liveness probe of a rollout server. SGLang's ``/health_generate`` generates a token and
# answers 503 while generation is paused (a weight update), so the launcher asks ``/health``.
HEALTH_PATH = "/health"


# ----------------------------------------------------------------------------- planning / dry run


def resolve_device(cfg: ExperimentConfig) -> str:
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def make_layout(
    cfg: ExperimentConfig, device: Optional[str] = None, ports: Optional[list] = None
) -> Layout:
    alloc = parse_allocation(cfg.allocation)
    if (
        alloc.rollout is not None
        and not cfg.rollout.server_addrs
        and alloc.rollout_backend != cfg.rollout.backend
    ):
        raise ConfigError(
            f"rollout.backend={cfg.rollout.backend!r} but allocation="
            f"{cfg.allocation!r} starts {alloc.rollout_backend!r} servers; make "
            "them agree"
        )
    return plan_layout(
        alloc,
        device=device or resolve_device(cfg),
        n_nodes=cfg.cluster.n_nodes,
        gpus_per_node=cfg.cluster.n_gpus_per_node,
        external_servers=cfg.rollout.server_addrs,
        ports=ports,
    )


def weight_group(cfg: ExperimentConfig, layout: Layout) -> Optional[WeightGroup]:
    """The broadcast group the trainer forms with this layout's servers when
    ``rollout.weight_update`` resolves to ``distributed`` (GPU, one trainer pipeline stage);
    None for the disk path. Same function as the trainer's sender; raises ConfigError."""
    a = layout.allocation
    try:
        mode = resolve_weight_update(
            cfg.rollout.weight_update,
            cuda=layout.device == "cuda",
            pp=a.trainer.pp,
            lora=cfg.lora.enabled,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mode != "distributed":
        return None
    n = len(layout.external_servers) if layout.external_servers else None
    return weight_update_group(a, cfg.rollout.backend, n)


def algorithm_line(cfg: ExperimentConfig) -> str:
    """The resolved keys that define the algorithm (every key a preset can set), one line."""
    alg = cfg.algorithm
    keys = sorted(
        {
            k.split(".", 1)[1]
            for keys in PRESETS.values()
            for k in keys
            if k.startswith("algorithm.")
        }
        | {"ratio_level"}
    )
    vals = " ".join(f"{k}={getattr(alg, k)}" for k in keys)
    teacher = ""
    if alg.opd != "off":
        teacher = f" teacher={cfg.teacher.path or cfg.teacher.server_addrs}"
    return (
        f"algorithm (preset {alg.preset or 'none'}): {vals} "
        f"critic.enabled={cfg.critic.enabled}{teacher}"
    )


def describe(cfg: ExperimentConfig, device: Optional[str] = None) -> str:
    """The ``--dry-run`` report: layout and per-GPU memory estimate."""
    layout = make_layout(cfg, device)
    out = [
        f"config OK: {cfg.name} (mode {cfg.mode}, {cfg.total_steps} steps, "
        f"recover {cfg.recover}, run_dir {cfg.logging.run_dir})",
        "layout:",
        layout.describe(),
    ]
    group = weight_group(cfg, layout)
    if group is None:
        out.append("weight update: disk (HF safetensors directory under the run directory)")
    else:
        out.append(
            f"weight update: distributed, group world {group.world_size} = trainer rank "
            f"0 + {len(group.rank_offsets)} server(s) x {group.ranks_per_server} "
            f"rank(s); rank offsets {', '.join(map(str, group.rank_offsets))}"
        )
    if layout.servers:
        out += describe_servers(cfg, planned_layout(cfg).servers[0], layout.device)
    out.append(algorithm_line(cfg))
    hp, source = resolve_hparams(cfg)
    dims = layout.allocation.trainer
    recompute = cfg.model.recompute_granularity
    est = estimate_memory(
        hp,
        dims,
        dtype=cfg.model.dtype,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        tokens_per_mb=cfg.scheduler.max_tokens_per_mb,
        recompute=recompute,
        sequence_parallel=cfg.actor.sequence_parallel,
        overhead_bytes=0 if layout.device == "cpu" else DEFAULT_OVERHEAD_BYTES,
        reference=cfg.ref.enabled,
        **lora_estimate_args(cfg.lora),
        freeze_vision=cfg.model.freeze_vision,
    )
    cap = None if layout.device == "cpu" else cfg.cluster.gpu_memory_gb
    where = "process" if layout.device == "cpu" else "GPU"
    out.append(
        f"trainer memory per {where} (model numbers from {source}; "
        f"{cfg.model.dtype}, distributed optimizer "
        f"{'on' if cfg.optimizer.use_distributed_optimizer else 'off'}, "
        f"{cfg.scheduler.max_tokens_per_mb} tokens/micro-batch, recompute {recompute}):"
    )
    out.append(est.format(cap, unit=where))
    a = layout.allocation
    if a.rollout is not None and not layout.external_servers and layout.device != "cpu":
        frac = memory_fraction(cfg)
        key = "gpu_memory_utilization" if cfg.rollout.backend == "vllm" else "mem_fraction_static"
        r = rollout_memory(
            hp, a.rollout.tp, a.rollout.pp, cfg.cluster.gpu_memory_gb, frac, cfg.model.dtype
        )
        out.append(
            f"rollout memory per GPU: weights {r['weights_gib']} GiB, KV cache "
            f"{r['kv_cache_gib']} GiB (~{r['kv_tokens']:,} tokens) at {key}={frac}"
        )
    return "\n".join(out)


# ----------------------------------------------------------------------------- process specs


def trainer_command(config_path: Path, nproc: int, extra: Optional[list] = None) -> list:
    """The trainer's command on this machine: ``torch.distributed.run --standalone`` (it picks
    a free port) for several ranks; one rank runs as it is, without torchrun's agent process
    (~2.5 s of imports less per launch and relaunch on a CPU; its exit code and signal are
    the rank's own)."""
    trainer = ["-m", TRAINER_MODULE, "--config", str(config_path), *(extra or [])]
    if nproc == 1:
        return [sys.executable, *trainer]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        *trainer,
    ]


def resume_point(cfg: ExperimentConfig) -> Optional[Path]:
    """The checkpoint a (re)launched trainer will resume from (``recover=auto``), if any."""
    if cfg.recover != "auto":
        return None
    return RunDir.from_config(cfg).latest_checkpoint()


def cpu_threads_per_trainer_rank(
    n_cores: int, *, n_servers: int, nproc: int, server_threads: int = 1, configured: int = 0
) -> int:
    """Threads for each trainer rank on a CPU-only machine (pure): ``configured`` when set,
    else the cores the servers' threads leave, shared by the ranks (at least 1)."""
    if configured:
        return configured
    return max(1, (n_cores - n_servers * server_threads) // max(1, nproc))


def server_spec(
    cfg: ExperimentConfig, slot, host: str, restartable: bool, secret_env: dict, device: str
) -> ProcessSpec:
    """The supervised process ``rollout<index>`` of one local rollout server."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slot.gpus))} if slot.gpus else {}
    env.update(backend_env(cfg, device))
    env.update(secret_env)
    return ProcessSpec(
        f"rollout{slot.index}",
        server_command(cfg, slot, host),
        env=env,
        ready=http_ready(f"http://{host}:{slot.port}{HEALTH_PATH}", api_key=cfg.rollout.api_key),
        ready_timeout_s=cfg.cluster.server_ready_timeout_s,
        restart=restartable,
    )


def restartable_rollout(cfg: ExperimentConfig, layout: Layout) -> bool:
    """Whether a killed rollout worker is relaunched alone: RL mode with disk weight updates.
    A killed server is relaunched alone (same port) in RL mode whatever the updates: the worker
    brings it to the current weights from ``<run_dir>/weights/v*`` (disk) or it is held pending
    until the trainer's next broadcast re-forms the group with it (distributed)."""
    return cfg.mode == "rl" and weight_group(cfg, layout) is None


def write_run_config(cfg: ExperimentConfig, addrs: list) -> Path:
    """Write ``<run_dir>/config.yaml`` (the resolved config with ``rollout.server_addrs`` =
    ``addrs``; mode 0600 when it holds a secret), which every process of the run reads."""
    resolved = config_to_dict(cfg)
    resolved["rollout"]["server_addrs"] = list(addrs)
    config_path = RunDir.from_config(cfg).config_file
    write_run_file(
        config_path, yaml.safe_dump(resolved, sort_keys=False), private=holds_secret(resolved)
    )
    return config_path


def worker_spec(cfg: ExperimentConfig, config_path: Path, restartable: bool) -> ProcessSpec:
    """The supervised process ``rollout_worker`` (RL mode)."""
    paths = RunDir.from_config(cfg)
    worker_argv = [sys.executable, "-m", ROLLOUT_WORKER_MODULE, "--config", str(config_path)]
    return ProcessSpec(
        "rollout_worker",
        worker_argv,
        env={"CUDA_VISIBLE_DEVICES": ""},
        # its data-plane window and control socket face the trainer
        restart_with_main=True,
        restart=restartable,
        # alone, it continues this run (prompt position, weights)
        on_restart=lambda spec, n: worker_argv + ["--relaunched"],
        # e.g. the failure-rate ceiling: a relaunch fails again
        fatal=lambda rc: (
            None
            if rc != FATAL_EXIT_CODE
            else paths.read_fatal() or "the rollout worker stopped with a fatal error (see its log)"
        ),
    )


def trainer_spec(
    cfg: ExperimentConfig, argv: list, env: dict, name: str = "trainer"
) -> ProcessSpec:
    """The supervised trainer process (``kind="main"``): relaunched under ``recover=auto``
    (it resumes by itself from the latest complete checkpoint); a fatal error or a full
    checkpoint disk ends the run."""
    paths = RunDir.from_config(cfg)

    def on_restart(spec: ProcessSpec, attempt: int) -> None:
        latest = resume_point(cfg)
        print(
            f"[launch] {name} relaunch {attempt}: "
            f"{f'resuming from {latest}' if latest else 'no complete checkpoint yet'}",
            file=sys.stderr,
            flush=True,
        )
        return None  # same command: under recover=auto the trainer resumes by itself

    def fatal(rc: int) -> Optional[str]:
        if paths.read_fatal():
            return paths.read_fatal()
        if rc == FATAL_EXIT_CODE:
            return "the trainer stopped with a fatal error (see its log)"
        free = free_bytes(paths.checkpoint_root)  # its own report may not fit on a full disk
        if free is not None and free < LOW_SPACE_BYTES:
            return f"no space left on device under {paths.checkpoint_root} ({free} bytes free)"
        return None

    return ProcessSpec(
        name,
        argv,
        env=env,
        kind="main",
        restart=cfg.recover == "auto",
        on_restart=on_restart,
        fatal=fatal,
    )


def build_specs(
    cfg: ExperimentConfig, device: Optional[str] = None, host: str = "127.0.0.1"
) -> tuple:
    """Plan, pick ports, write ``<run_dir>/config.yaml`` (mode 0600 when it holds a secret);
    returns ``(specs, layout)``."""
    device = device or resolve_device(cfg)
    external = bool(cfg.rollout.server_addrs)
    alloc = parse_allocation(cfg.allocation)
    n = 0 if external or alloc.rollout is None else alloc.rollout.dp
    layout = make_layout(cfg, device, ports=free_ports(n, host))
    if (
        layout.n_nodes > 1
        and device != "cpu"
        and (len(set(s.node for s in layout.servers) | set(layout.trainer_nodes)) > 1)
    ):
        raise ConfigError(
            f"cluster.n_nodes={cfg.cluster.n_nodes}: launch.local runs one "
            "machine; use launch/slurm/ or launch/torchrun.sh for several nodes"
        )
    specs = []
    addrs = list(cfg.rollout.server_addrs)
    secret_env = server_secrets(cfg) if layout.servers else {}
    restartable = restartable_rollout(cfg, layout)
    for slot in layout.servers:
        specs.append(server_spec(cfg, slot, host, cfg.mode == "rl", secret_env, device))
        addrs.append(f"{host}:{slot.port}")
    config_path = write_run_config(cfg, addrs)
    env = (
        {"CUDA_VISIBLE_DEVICES": ",".join(map(str, layout.trainer_gpus))}
        if layout.trainer_gpus
        else {}
    )
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        # the servers hold cluster.cpu_threads_per_server cores each; the trainer ranks share
        # the rest (oversubscribing the cores slows both sides more than it gains)
        env["OMP_NUM_THREADS"] = str(
            cpu_threads_per_trainer_rank(
                os.cpu_count() or 1,
                n_servers=len(layout.servers),
                nproc=layout.trainer_nproc_per_node,
                server_threads=cfg.cluster.cpu_threads_per_server,
                configured=cfg.cluster.cpu_threads_per_trainer_rank,
            )
        )
    if layout.trainer_nproc_per_node == 1:
        # what torchrun hands its ranks (socket.getfqdn()): the address of the weight-update
        # group, which servers on other machines dial; one rank started alone gets it here
        env["MASTER_ADDR"] = socket.getfqdn()
    RunDir.from_config(cfg).fatal_file.unlink(missing_ok=True)  # not this attempt's reason
    if cfg.mode == "rl":
        specs.append(worker_spec(cfg, config_path, restartable))
    specs.append(
        trainer_spec(cfg, trainer_command(config_path, layout.trainer_nproc_per_node), env)
    )
    return specs, layout


# ----------------------------------------------------------------------------- multi-node helpers


def planned_layout(cfg: ExperimentConfig) -> Layout:
    """The cluster layout with deterministic ports (``cluster.server_base_port`` + index of the
    server on its node), as the sbatch scripts use it."""
    lay = make_layout(cfg)
    per_node: dict = {}
    slots = []
    for s in lay.servers:
        k = per_node.get(s.node, 0)
        per_node[s.node] = k + 1
        slots.append(type(s)(s.index, s.node, s.gpus, cfg.cluster.server_base_port + k))
    lay.servers = slots
    return lay


def layout_env(cfg: ExperimentConfig, rollout_hosts: Optional[list] = None) -> dict:
    """Shell variables for ``launch/slurm/*.sbatch`` (``eval "$(... --print-layout-env)"``)."""
    lay = planned_layout(cfg)
    rollout_nodes = sorted({s.node for s in lay.servers})
    env = {
        "ROLLOUT_NNODES": len(rollout_nodes),
        "N_SERVERS": len(lay.servers),
        "TRAINER_NNODES": len(lay.trainer_nodes),
        "TRAINER_NPROC_PER_NODE": lay.trainer_nproc_per_node,
        "TRAINER_WORLD_SIZE": lay.trainer_world_size,
        "TRAINER_GPUS": ",".join(map(str, lay.trainer_gpus)),
        "TRAINER_MODULE": TRAINER_MODULE,
        "ROLLOUT_WORKER_MODULE": ROLLOUT_WORKER_MODULE if cfg.mode == "rl" else "",
        "SHARED_NODE": int(bool(rollout_nodes) and rollout_nodes[-1] in lay.trainer_nodes),
        "ROLLOUT_BACKEND": cfg.rollout.backend,
    }
    env["MAX_RESTARTS"] = cfg.cluster.max_restarts if cfg.recover == "auto" else 0
    group = weight_group(cfg, lay)
    env["WEIGHT_GROUP_WORLD_SIZE"] = group.world_size if group else 0
    if lay.external_servers:
        env["SERVER_ADDRS"] = ",".join(lay.external_servers)
    elif rollout_hosts is not None:
        if len(rollout_hosts) < len(rollout_nodes):
            raise ConfigError(
                f"--rollout-hosts: {len(rollout_hosts)} host(s) given, the layout "
                f"needs {len(rollout_nodes)}"
            )
        env["SERVER_ADDRS"] = ",".join(f"{rollout_hosts[s.node]}:{s.port}" for s in lay.servers)
    return env


def serve_node(cfg: ExperimentConfig, node: int) -> int:
    """Run (and supervise) the rollout servers that the layout puts on ``node``; for srun.
    They serve the network (0.0.0.0): ``rollout.api_key`` is required (ConfigError) unless
    ``rollout.allow_unauthenticated=true``, which is logged."""
    check_bind(
        "0.0.0.0",
        authenticated=bool(cfg.rollout.api_key),
        what=f"launch.local --serve-node {node}",
        fix=f"set rollout.api_key (without "
        f"argv: {API_KEY_FILE_ENV}=<a 0600 file>), or rollout.allow_unauthenticated=true "
        "on a trusted network",
        allow_unauthenticated=cfg.rollout.allow_unauthenticated,
    )
    if cfg.rollout.allow_unauthenticated and not cfg.rollout.api_key:
        print(
            f"[launch] WARNING: node {node}'s rollout servers bind 0.0.0.0 WITHOUT an API key "
            "(rollout.allow_unauthenticated=true)",
            file=sys.stderr,
            flush=True,
        )
    lay = planned_layout(cfg)
    mine = [s for s in lay.servers if s.node == node]
    if not mine:
        print(f"node {node}: no rollout servers in this layout", file=sys.stderr)
        return 0
    checked = check_server_runtime(cfg)  # before any process starts
    if checked:
        print(f"[launch] node {node}: {checked}", file=sys.stderr, flush=True)
    specs = []
    secret_env = server_secrets(cfg)
    for slot in mine:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slot.gpus))} if slot.gpus else {}
        env.update(backend_env(cfg, lay.device))
        env.update(secret_env)
        specs.append(
            ProcessSpec(
                f"rollout{slot.index}", server_command(cfg, slot, "0.0.0.0"), env=env, kind="main"
            )
        )
    host = socket.gethostname()
    return Supervisor(
        specs, RunDir.from_config(cfg).logs / f"node{node}-{host}", grace_s=cfg.cluster.kill_grace_s
    ).run()


# ----------------------------------------------------------------------------- CLI


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m areal_mega.launch.local", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--config", required=True, help="recipe YAML (recipes/*.yaml)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, print the layout and memory estimate, start nothing",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="plan for this device instead of cluster.device (dry runs on a laptop)",
    )
    p.add_argument(
        "--print-layout-env",
        action="store_true",
        help="print the layout as shell variables (for launch/slurm)",
    )
    p.add_argument(
        "--rollout-hosts",
        default=None,
        help="comma-separated rollout node hosts, to print SERVER_ADDRS",
    )
    p.add_argument(
        "--serve-node",
        type=int,
        default=None,
        metavar="K",
        help="run the rollout servers the layout puts on node K (srun per node)",
    )
    p.add_argument(
        "--print-resume",
        action="store_true",
        help="print the checkpoint a recover=auto trainer resumes from (or nothing)",
    )
    p.add_argument(
        "--check-rollout-env",
        action="store_true",
        help="check the rollout servers' interpreter (vLLM) and exit",
    )
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_against_model(cfg)
        if args.dry_run:
            print(describe(cfg, args.device))
            return 0
        if args.print_layout_env:
            hosts = args.rollout_hosts.split(",") if args.rollout_hosts else None
            for k, v in layout_env(cfg, hosts).items():
                print(f"{k}={shlex.quote(str(v))}")
            return 0
        if args.print_resume:
            latest = resume_point(cfg)
            print(latest or "")
            return 0
        if args.check_rollout_env:
            print(
                check_server_runtime(cfg)
                or f"rollout.backend={cfg.rollout.backend}: nothing to check"
            )
            return 0
        if args.serve_node is not None:
            return serve_node(cfg, args.serve_node)
        try:
            RunDir.from_config(cfg).check_fresh_start(cfg.recover)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not cfg.rollout.server_addrs:  # before any process starts
            checked = check_server_runtime(cfg)
            if checked:
                print(f"[launch] {checked}", file=sys.stderr, flush=True)
        specs, layout = build_specs(cfg, args.device)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(layout.describe(), file=sys.stderr, flush=True)
    sup = Supervisor(
        specs,
        RunDir.from_config(cfg).logs,
        grace_s=cfg.cluster.kill_grace_s,
        max_restarts=cfg.cluster.max_restarts,
    )
    scale = None
    if cfg.mode == "rl":  # launch.scale adds / removes servers while the job runs
        distributed = weight_group(cfg, layout) is not None
        scale = start_scale_service(
            cfg,
            sup,
            RunDir.from_config(cfg),
            layout,
            distributed_updates=distributed,
            make_spec=lambda slot: server_spec(
                cfg, slot, "127.0.0.1", True, server_secrets(cfg), layout.device
            ),
        )
    try:
        return sup.run()
    finally:
        if scale is not None:
            scale.close()


if __name__ == "__main__":
    sys.exit(main())

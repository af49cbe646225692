"""Submit ``launch/slurm/run.sbatch`` with the resources the recipe needs.

    python -m areal_mega.launch.slurm_submit [--dry-run] [SBATCH_OPTION ...] RECIPE [key=value ...]

``#SBATCH`` lines cannot read the recipe, so this wrapper does: it loads the recipe (and the
overrides) with the production config and allocation code, plans the layout, and calls
``sbatch --nodes=N [--gpus-per-node=G] [options] launch/slurm/run.sbatch RECIPE [key=value ...]``
where ``N`` is the number of nodes the layout uses and ``G`` is ``cluster.n_gpus_per_node``
(omitted for ``cluster.device=cpu``: such runs need no generic resources). Options before
RECIPE (``--partition=gpu``, ``--time=4:00:00``, ``--parsable``; always ``--opt=value``) go to
sbatch unchanged. ``PYTHON`` is exported as this interpreter unless already set, so the job runs
with the same dependencies, and ``AREAL_MEGA_ROOT`` as this repository. ``--dry-run`` prints
the command instead of running it. The rollout API key goes in ``AREAL_ROLLOUT_API_KEY_FILE``
(exported to the job), never as ``rollout.api_key=...`` (refused).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

from areal_mega.config import ConfigError, ExperimentConfig, load_config
from areal_mega.launch.local import make_layout
from areal_mega.security import API_KEY_FILE_ENV

SBATCH_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "slurm" / "run.sbatch"


def slurm_resources(cfg: ExperimentConfig) -> dict:
    """``{"nodes": N, "gpus_per_node": G}`` for ``cfg`` (G is 0 for ``cluster.device=cpu``).

    ``cluster.device=auto`` counts as ``cuda``: the compute nodes, not the submit host, decide,
    and the recipe's ``cluster.n_gpus_per_node`` describes them."""
    if cfg.cluster.device == "cpu":
        return {"nodes": 1, "gpus_per_node": 0}  # every process runs on node 0
    lay = make_layout(cfg, device="cuda")
    used = {s.node for s in lay.servers} | set(lay.trainer_nodes)
    return {"nodes": max(used) + 1, "gpus_per_node": cfg.cluster.n_gpus_per_node}


def sbatch_command(
    cfg: ExperimentConfig,
    recipe: str,
    overrides: Optional[list] = None,
    sbatch_options: Optional[list] = None,
    script: Path = SBATCH_SCRIPT,
) -> list:
    """The ``sbatch`` argv that submits ``script`` for ``recipe`` with ``cfg``'s resources."""
    res = slurm_resources(cfg)
    argv = ["sbatch", f"--nodes={res['nodes']}"]
    if res["gpus_per_node"]:
        argv.append(f"--gpus-per-node={res['gpus_per_node']}")
    return argv + list(sbatch_options or []) + [str(script), str(recipe), *(overrides or [])]


def split_args(argv: list) -> tuple:
    """``(dry_run, sbatch_options, recipe, overrides)`` from the command line."""
    dry_run, options, rest = False, [], list(argv)
    while rest and rest[0].startswith("-"):
        arg = rest.pop(0)
        if arg == "--dry-run":
            dry_run = True
        elif arg in ("-h", "--help"):
            raise SystemExit(__doc__)
        elif arg.startswith("--") and "=" in arg or arg == "--parsable":
            options.append(arg)
        else:
            raise ConfigError(f"sbatch option {arg!r}: write it as --name=value before RECIPE")
    if not rest:
        raise ConfigError("no RECIPE given (e.g. recipes/tiny-cpu.yaml)")
    return dry_run, options, rest[0], rest[1:]


def main(argv: Optional[list] = None) -> int:
    """Parse the command line, print the sbatch command and run it (unless ``--dry-run``)."""
    try:
        dry_run, options, recipe, overrides = split_args(
            list(sys.argv[1:] if argv is None else argv)
        )
        if any(o.startswith("rollout.api_key=") for o in overrides):
            raise ConfigError(
                f"rollout.api_key on the command line is refused (sbatch's argv "
                f"shows in ps and the job records): set {API_KEY_FILE_ENV}=<a "
                "chmod-600 file holding the key> instead"
            )
        cfg = load_config(recipe, overrides)
        cmd = sbatch_command(cfg, recipe, overrides, options)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(" ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    if dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)
    env.setdefault("AREAL_MEGA_ROOT", str(SBATCH_SCRIPT.parents[2]))  # run.sbatch's REPO
    try:
        return subprocess.run(cmd, env=env).returncode
    except FileNotFoundError:
        print("sbatch not found: run this on a Slurm submit host", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())

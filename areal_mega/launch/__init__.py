"""Launchers: the processes of a run, started, watched, relaunched and scaled.

- :mod:`.local` — ``python -m areal_mega.launch.local``: rollout servers, rollout worker and
  trainer (torchrun) on one machine, supervised; ``--dry-run`` prints the layout and memory;
- :mod:`.ray` — ``python -m areal_mega.launch.ray``: the same processes placed in Ray
  placement groups across a running Ray cluster, supervised the same way (needs ``.[ray]``);
- :mod:`.ray_placement` — the placement groups of a layout and their nodes (pure);
- :mod:`.reaper` — stops a process tree once the Ray actor that started it is gone;
- :mod:`.supervisor` — a generic process supervisor: start a list of specs, watch them,
  relaunch, stop them all;
- :mod:`.server_commands` — each rollout backend's server process: command line, environment,
  secret, interpreter check (the backends' own pieces are :mod:`areal_mega.backends`);
- :mod:`.plan` — placement of rollout servers and trainer ranks on nodes and GPUs (pure);
- :mod:`.memory` — the per-GPU memory estimate of a trainer layout (pure);
- :mod:`.slurm_submit` — ``sbatch`` of ``launch/slurm/run.sbatch`` with the resources a recipe
  needs;
- :mod:`.scale` — ``python -m areal_mega.launch.scale``: add or remove rollout servers of a
  running job;
- :mod:`.elastic` — ``launch.local``'s side of that: the server membership of a running job;
- :mod:`.operations` — scale commands as operations, one at a time, each with its deadline,
  readable while they run.
"""

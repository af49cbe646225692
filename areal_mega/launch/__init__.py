"""Launching a run: the processes, where they go, and keeping them alive.

- :mod:`.local` -- the single-machine launcher (``python -m areal_mega.launch.local``): rollout
  servers, the rollout worker and the trainer under torchrun, supervised;
- :mod:`.supervisor` -- a generic process supervisor: start, watch, relaunch, stop;
- :mod:`.plan` -- placement of servers and trainer ranks on nodes and GPUs (pure);
- :mod:`.memory` -- the per-GPU memory estimate of a trainer layout (pure);
- :mod:`.server_commands` -- each rollout backend's server process (command line, environment,
  secret, interpreter check; the backends' own pieces are :mod:`areal_mega.backends`);
- :mod:`.elastic`, :mod:`.scale`, :mod:`.operations` -- elastic rollout: the server membership
  of a running job, the commands that add or remove servers, run one at a time;
- :mod:`.slurm_submit` -- submitting ``launch/slurm/run.sbatch`` with the resources a recipe
  needs."""

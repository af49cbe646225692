"""The parallel layout: the allocation string, the process-group mesh, the weight-update group.

- :mod:`.allocation` — ``<rollout>:<dims>+<trainer>:<dims>`` parsed and checked (pure);
- :mod:`.mesh` — :class:`ParallelMesh`, the one place that creates torch.distributed process
  groups;
- :mod:`.weight_group` — the weight-update group shared by the trainer's sender and the
  rollout servers: its ranks against the layout (pure) and the process group that forms it,
  created the way SGLang creates it.
"""

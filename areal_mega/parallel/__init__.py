"""The parallel layout: the allocation string, the process-group mesh, the weight-update group.

- :mod:`.allocation` — ``<rollout>:<dims>+<trainer>:<dims>`` parsed and checked (pure);
- :mod:`.mesh` — :class:`ParallelMesh`, the one place that creates torch.distributed process
  groups;
- :mod:`.weight_group` — the weight-update group's ranks against the layout (pure);
- :mod:`.update_group` — the weight-update process group, created the way SGLang creates it.
"""

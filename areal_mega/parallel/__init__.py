"""Parallel layout: where ranks go and the groups they form.

- :mod:`.allocation` -- allocation strings (``sglang:d4t2+megatron:d2p2t2``), parsed (pure);
- :mod:`.mesh` -- the trainer's process-group mesh (data, tensor, pipeline, context, expert);
- :mod:`.weight_group` -- the weight-update group shared by the trainer's sender and the
  rollout servers: its shape (pure) and the process group that forms it."""

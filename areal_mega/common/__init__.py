"""Small helpers every process uses, each written once.

- :mod:`.files` -- atomic file writes;
- :mod:`.net` -- free ports and readiness probes;
- :mod:`.signals` -- SIGTERM on a watchdog thread;
- :mod:`.loading` -- loading an object named in a config (and the table of moved names);
- :mod:`.log_tail` -- the error a dead process left in its log;
- :mod:`.proc_memory` -- this process's memory from ``/proc/self/status`` (peak RSS, the
  anonymous peak over a block);
- :mod:`.counters` -- process-wide event counters of the rollout side;
- :mod:`.moe_routes` -- routed experts: layout, wire encoding, per-sample table.

Nothing here imports another part of ``areal_mega``."""

"""Small helpers every process uses, each written once. Nothing here imports another part of
``areal_mega``.

- :mod:`.files` — atomic file writes;
- :mod:`.net` — free ports and readiness probes;
- :mod:`.loading` — loading an object a config names (``pkg.mod:name`` / ``file.py:name``),
  with the alias table of moved names;
- :mod:`.signals` — SIGTERM heard on a watchdog thread, whatever the main thread is doing;
- :mod:`.counters` — process-wide event counters of the rollout side (sandbox kills and
  timeouts, gateway sessions);
- :mod:`.log_tail` — the error a dead process left in its log, for one-line death notices;
- :mod:`.proc_memory` — this process's memory from ``/proc/self/status`` (peak RSS, the
  anonymous peak over a block);
- :mod:`.env_switch` — an environment variable that takes one of a fixed set of names;
- :mod:`.malloc` — glibc's policy for large tensor buffers: returned when freed (a conversion)
  or reused step after step (a CPU trainer);
- :mod:`.http_guard` — what every HTTP endpoint of ours does against hostile clients: strict
  JSON, body limits and timeouts, a connection cap that refuses cheaply;
- :mod:`.errors` — ``ConfigError``, the config error every layer raises;
- :mod:`.moe_routes` — routed experts of a mixture-of-experts model: the layout, SGLang's wire
  encoding, the per-sample table;
- :mod:`.native` — the compiled kernel modules, loaded once (a truncated build refused);
- :mod:`.cpu_bf16` — whether this CPU has bf16 GEMMs; where not, bf16 products in fp32.
"""

"""Small helpers every process uses, each written once: atomic file writes
(:mod:`.files`), free ports and readiness probes (:mod:`.net`), SIGTERM on a watchdog thread
(:mod:`.signals`), loading an object named in a config (:mod:`.loading`) and the config
error every layer raises (:mod:`.errors`). Nothing here imports another part of ``areal_mega``."""

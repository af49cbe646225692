"""Stand-in for the rollout worker in launcher tests: checks its config, records its pid in
``$FAKE_PID_DIR/worker.pid`` and serves (sleeps) until stopped."""

import os
import sys
import time

from areal_mega.config import load_config

args = sys.argv[1:]
i = args.index("--config")
cfg = load_config(args[i + 1], args[:i] + args[i + 2 :])
assert cfg.rollout.server_addrs, "worker got no servers"
with open(os.path.join(os.environ["FAKE_PID_DIR"], "worker.pid"), "w") as f:
    f.write(str(os.getpid()))
print(f"worker serving {cfg.rollout.server_addrs}", flush=True)
time.sleep(3600)

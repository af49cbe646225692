"""The online gateway alone (no rollout server: opening sessions needs none) in a process whose
file descriptor limit is low: ``python -m tests.helpers.gateway_fd_limit_worker RUN_DIR NOFILE
CONFIG_JSON``.
Prints ``{"base_url", "admin_api_key"}`` once serving, serves until stdin closes, then prints
the gateway's connection counters."""

import asyncio
import json
import resource
import sys

from areal_mega.common import counters
from areal_mega.config import OnlineConfig
from areal_mega.rollout.controller import GroupContext, RolloutController
from areal_mega.workflow.online_gateway import OnlineWorkflow


def main() -> None:
    run_dir, nofile, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    wf = OnlineWorkflow(OnlineConfig(**cfg), n_samples=64, run_dir=run_dir)
    ctl = RolloutController(None, wf, [], batch_size=1, n_samples=64, eta=0, sink=print)

    async def go():
        slot = asyncio.ensure_future(wf.arun_episode(GroupContext(ctl, 0), {}, 64))
        while not wf.book.free_slots:
            await asyncio.sleep(0.01)
        print(json.dumps({"base_url": wf.base_url, "admin_api_key": wf.admin_key}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        slot.cancel()
        await wf.close()
        print(
            json.dumps(
                {k: v for k, v in counters.snapshot().items() if k.startswith("online/connections")}
            ),
            flush=True,
        )

    asyncio.run(go())


if __name__ == "__main__":
    main()

"""Run a scenario of :mod:`tests.helpers.lora_worker` on its ranks and read their results."""

import os

from areal_mega.common.net import free_port
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd


def launch(scenario, out, world=2, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    port = str(free_port())
    ranks = run_ranks(
        [worker_cmd("lora_worker", scenario, r, world, port, out) for r in range(world)],
        timeout=timeout,
        env=env,
    )
    return rank_results([out / f"{scenario}.{r}.json" for r in range(world)], ranks)

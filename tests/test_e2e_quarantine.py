"""A journaled sample that crashes the trainer is quarantined, not replayed forever (CPU,
launch.local, the tiny model).

A finished 1-step run leaves a checkpoint and its journal. A complete prompt group is then
journaled (through the production journal writer, as an intake would) whose one sample holds
a token id far outside the vocabulary: every trainer that trains it dies in the embedding
lookup. Relaunched with more steps, the trainer replays the journal and dies on that
micro-batch; the supervisor relaunches it, it dies on the same micro-batch again; the next
relaunch quarantines the micro-batch's samples (``quarantine.jsonl``, with the error) and the
run finishes: every other sample trained once, none trained twice. Before, every relaunch
died the same way and the run ended with exit 1 after ``cluster.max_restarts``.

Both launches join one CPU rollout server (``rollout.server_addrs``: launch.local starts none),
brought back before each to what a server launch.local starts holds (the model's weights at
version 0, generating).
"""

import json
import time

import numpy as np
import pytest

from areal_mega.dataplane.journal import TrajectoryJournal
from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.inference.process import launch_local_servers
from tests.helpers.local_runs import _finish, _launch, _metrics, _trained, server_addrs_on

pytestmark = pytest.mark.slow

SMALL_MBS = ("scheduler.max_tokens_per_mb=48", "checkpoint.save_every=1", "recover=auto")


@pytest.fixture(scope="module")
def rollout_server(assets):
    """One CPU rollout server on the tiny model for both launches."""
    (srv,) = launch_local_servers(str(assets[0]), 1)
    try:
        yield srv
    finally:
        srv.stop()


def test_a_sample_that_kills_the_trainer_is_quarantined(assets, rollout_server, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run, model, data, "total_steps=1", *SMALL_MBS, server_addrs_on(rollout_server, model)
        ),
        timeout=300,
    )
    assert rc == 0, out[-3000:]
    poison = []
    for i in range(4):  # one complete group (rollout.n_samples=4)
        ids = np.array([5, 6, 7, 8, 9, 10 + i], np.int32)
        if i == 0:
            ids[-1] = 10**6  # no such token: the embedding lookup fails
        mask = np.array([0, 0, 0, 1, 1, 1], np.int8)
        poison.append(
            Trajectory(
                input_ids=ids,
                loss_mask=mask,
                logprobs=-0.5 * mask.astype(np.float32),
                versions=np.where(mask > 0, 1, -1).astype(np.int32),
                reward=float(i % 2),
                sample_id=f"poison-{i}",
                group_id="poison-group",
                prompt_len=3,
                created_at=time.time(),
            )
        )
    journal = TrajectoryJournal(run / "journal")
    journal.append(poison)
    journal.close()

    t0 = time.monotonic()
    # the poisonous group waits behind those already pending: steps 2..5 reach it
    rc, out = _finish(
        _launch(
            run, model, data, "total_steps=5", *SMALL_MBS, server_addrs_on(rollout_server, model)
        ),
        timeout=1200,
    )
    took = time.monotonic() - t0
    assert rc == 0, out[-3000:]
    assert out.count("relaunch") >= 2, out[-3000:]  # died twice on it, then went on
    lines = [json.loads(x) for x in (run / "quarantine.jsonl").read_text().splitlines()]
    quarantined = {x["sample_id"] for x in lines}
    assert "poison-0" in quarantined, lines
    assert all("IndexError" in x["error"] or "index" in x["error"] for x in lines), lines
    trained = [sid for r in _trained(run) for sid in r["sample_ids"]]
    assert len(trained) == len(set(trained))  # nothing trained twice
    assert not quarantined & set(trained)  # no quarantined one trained
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4, 5]
    rows = _metrics(run)
    assert rows[-1]["quarantine/samples"] == len(quarantined)
    assert sum(r.get("refused/quarantine", 0.0) for r in rows) == len(quarantined)
    print(f"quarantined {len(quarantined)} samples; the relaunched run took {took:.0f} s")

"""A trainer killed with SIGKILL mid-run, rollout groups of different sizes (a user workflow that
keeps 1 to 4 samples per prompt): the resumed run trains every prompt in exactly one step, loses
none, and keeps the staleness bound (the worker counts accepted groups, not samples / n)."""

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.local_runs import (
    _accepted_ids,
    _finish,
    _launch,
    _metrics,
    _snapshot_live_run,
    _trained,
    _trainer_pid,
)

pytestmark = pytest.mark.slow

WORKFLOW = '''
import json


async def episode(ctx, item, log_path=""):
    """Prompt k keeps 1 + k % 4 of its samples; each kept sample logs (sample id, prompt)."""
    k = int(item["prompt_index"])
    if ctx.sample_index >= 1 + k % 4:
        ctx.failed = "this prompt keeps fewer samples"
        return 0.0
    ids = ctx.prompt_ids(item)
    gen = await ctx.generate(ids, ctx.max_new_tokens)
    seq = ctx.new_sequence(ids)
    seq.add_generated(gen.output_ids, gen.logprobs, gen.versions)
    with open(log_path, "a") as f:
        f.write(json.dumps([ctx.sample_id, k]) + "\\n")
    return [ctx.trajectory(seq, float(sum(gen.output_ids) % 2), len(ids), gen.finish_reason,
                           server_id=gen.server)]
'''


def _prompt_of(log: Path) -> dict:
    return dict(json.loads(x) for x in log.read_text().splitlines() if x.strip())


def test_sigkill_trainer_with_variable_group_sizes_trains_each_prompt_once(assets, tmp_path):
    model, data = assets
    run, flow, log = tmp_path / "run", tmp_path / "fewer.py", tmp_path / "samples.jsonl"
    flow.write_text(textwrap.dedent(WORKFLOW))
    total = 6
    proc = _launch(
        run,
        model,
        data,
        f"total_steps={total}",
        "recover=auto",
        "checkpoint.save_every=2",
        "cluster.max_restarts=1",
        "logging.plot=false",
        f"rollout.workflow={flow}:episode",
        f"rollout.workflow_kwargs.log_path={log}",
    )
    deadline = time.time() + 240
    while time.time() < deadline and len(_metrics(run)) < 3:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.2)
    assert len(_metrics(run)) >= 3, "the run did not reach step 3"
    pid = _trainer_pid(run)
    assert pid is not None
    snap = _snapshot_live_run(run, tmp_path / "before_kill")  # accepted before the crash
    os.kill(pid, signal.SIGKILL)  # step 3 is past the checkpoint of step 2
    rc, out = _finish(proc, timeout=300)
    assert rc == 0, out[-4000:]
    assert "resumed from" in (run / "logs" / "trainer.log").read_text()

    prompt = _prompt_of(log)
    trained = _trained(run)
    assert [r["step"] for r in trained] == list(range(1, total + 1))
    steps_of: dict = {}
    for r in trained:
        for s in r["sample_ids"]:
            steps_of.setdefault(prompt[s], set()).add(r["step"])
    repeated = {k: sorted(v) for k, v in steps_of.items() if len(v) > 1}
    assert not repeated, f"{len(repeated)} prompts trained in more than one step: {repeated}"
    # every prompt up to the last one trained is trained, or accepted and still pending
    held = {prompt[s] for s in _accepted_ids(run)}
    lost = sorted(set(range(max(steps_of) + 1)) - held)
    assert not lost, f"{len(lost)} prompts lost: {lost}"
    # groups really differ in size, and whole groups are trained
    sizes = {}
    for s in (x for r in trained for x in r["sample_ids"]):
        sizes[prompt[s]] = sizes.get(prompt[s], 0) + 1
    assert {sizes[k] for k in sizes} == {1, 2, 3, 4}
    assert all(n == 1 + k % 4 for k, n in sizes.items()), sizes
    lost_samples = _accepted_ids(snap) - _accepted_ids(run)
    assert not lost_samples, f"{len(lost_samples)} accepted samples lost"
    # the resumed worker counted accepted groups exactly: the staleness bound (1) still holds
    stale = [r["staleness/max"] for r in _metrics(run)]
    assert max(stale) <= 1, stale
    worker_log = (run / "logs" / "rollout_worker.log").read_text()
    assert "resume: " in worker_log, worker_log[-3000:]

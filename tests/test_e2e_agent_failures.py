"""``launch.local`` (CPU, tiny model) with an external agent that fails on nearly every task
(``tests/helpers/mostly_failing_agent.py``, a plain ``openai`` script) and the default failure
settings but a small window: the dropped share passes ``rollout.failure_rate_ceiling`` and the run
stops with one clear error naming the rate, the window and the config keys; the rollout worker is
not relaunched (``recover=auto`` would allow it). The converse, an agent that fails on some tasks
in a run that completes with its drops and failures by reason in ``metrics.jsonl``, is
``tests/test_e2e_trackers.py``."""

import json
import re
import sys

from areal_mega.run_dir import FATAL_EXIT_CODE
from tests.helpers.local_runs import ROOT, _finish, _launch

ERROR = re.compile(
    r"rollout worker: (\d+) of the last (\d+) prompts failed \(rate (\d\.\d\d) > "
    r"rollout\.failure_rate_ceiling=0\.5, window rollout\.failure_window=8 prompts, checked "
    r"from rollout\.failure_min_prompts=4; by reason: out_of_retries=(\d+)\); the last: "
    r"episode failed 3 times: every sample of group \S+ failed: exit_code: exited with 1\. "
    r"Too many tasks fail: .* raise rollout\.failure_rate_ceiling \(1 never stops\); not "
    r"relaunching"
)


def test_an_agent_failing_on_nearly_every_task_stops_the_run_with_one_clear_error(assets, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    agent = {
        "command": f"{sys.executable} {ROOT / 'tests/helpers/mostly_failing_agent.py'}",
        "timeout_s": 120,
        "max_concurrent": 2,
    }
    rc, out = _finish(
        _launch(
            run,
            model,
            data,
            "total_steps=50",
            "rollout.batch_size=2",
            "rollout.n_samples=2",
            "logging.plot=false",
            "rollout.workflow=areal_mega.workflow.external_agent:ExternalAgent",
            f"rollout.workflow_kwargs={json.dumps(agent)}",
            "rollout.failure_window=8",
            "rollout.failure_min_prompts=4",
        ),
        timeout=300,
    )
    assert rc == FATAL_EXIT_CODE, out[-3000:]
    supervisor = (run / "logs" / "supervisor.log").read_text()
    said = ERROR.findall(supervisor)
    assert len(said) == 1, supervisor[-3000:]
    failed, n, rate, dropped = (
        int(said[0][0]),
        int(said[0][1]),
        float(said[0][2]),
        int(said[0][3]),
    )
    assert 4 <= n <= 8 and failed == dropped and rate == round(failed / n, 2) > 0.5
    assert "rollout_worker failed (exit code 78)" in supervisor
    assert "not relaunching" in supervisor and "relaunch 1/" not in supervisor
    assert json.loads((run / "fatal.json").read_text())["message"] in supervisor
    worker = (run / "logs" / "rollout_worker.log").read_text()
    assert worker.count("error: rollout failed: ") == 1 and "Traceback" not in worker
    assert "prompt dropped after 3 attempts" in worker

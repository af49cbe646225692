"""launch/slurm on a real Slurm (Debian's slurm-wlm + munge): a throwaway cluster of two node
names on this machine (see tests/helpers/slurm_cluster.py), started and stopped by the test.

- the CPU recipe submitted with plain ``sbatch`` is ``scancel``-ed mid-run and leaves no
  process behind; resubmitted through the submit wrapper (no GPU generic resource), the job
  resumes it (``recover=auto``) and completes with every step in the run's metrics;
- the multi-node branch of run.sbatch on two nodes: a real rollout server step on the first,
  the trainer step (torchrun.sh; a stand-in trainer that crashes once) on the second, the
  bounded relaunch, cleanup of the rollout step;
- the vLLM branch without its interpreter: the job fails before any step, saying what to do.

Skipped (with the reason) where the Slurm or munge programs are missing or we are not root;
``.ci/run`` installs them when it can.
"""

import os
import sys
from pathlib import Path

import pytest

from areal_mega.common.net import free_ports
from tests.helpers.local_runs import _metrics, run_overrides
from tests.helpers.slurm_cluster import SlurmCluster, job_processes, missing_binaries, poll

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures_launch"
_missing = missing_binaries()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        bool(_missing),
        reason=f"no Slurm here (missing {', '.join(_missing)}; apt-get install slurm-wlm munge)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmd must run as root"),
]
JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from areal_mega.data.synthetic import write_task_files
    from areal_mega.models.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("slurm-assets")
    model = make_tiny_model(
        d / "model",
        arch="llama",
        charset="digits",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )
    write_task_files(d / "data", task="reverse", n_train=256, n_test=16)
    return model, d / "data"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=("n1", "n2")) as c:
        yield c


def _job_env(*pythonpath) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([*map(str, pythonpath), str(ROOT)]),
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PYTHON", None)
    if not (ROOT / ".venv" / "bin" / "python").exists():  # else run.sbatch's default
        env["PYTHON"] = sys.executable
    return env


def _overrides(run_dir, model, data, *extra) -> list:
    """The tiny-cpu recipe's end-to-end overrides (tests/helpers/local_runs.py), smaller
    steps, a checkpoint every step."""
    return [
        *run_overrides(run_dir, model, data),
        "rollout.batch_size=2",
        "rollout.n_samples=2",
        "checkpoint.save_every=1",
        *extra,
    ]


def _finished(cluster, job_id, out: Path) -> dict:
    try:
        job = cluster.wait_job(job_id, JOB_TIMEOUT_S)
    except TimeoutError:
        cluster.run(["scancel", str(job_id)], check=False)
        pytest.fail(f"job {job_id} did not finish:\n{_tail(out)}\n{cluster.logs()}")
    poll(lambda: not job_processes(job_id), 60, f"job {job_id} processes gone")
    return job


def _tail(path: Path, n: int = 60) -> str:
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-n:])
        if path.exists()
        else f"(no {path})"
    )


def test_cpu_recipe_runs_is_cancelled_cleanly_and_resumes(cluster, assets, tmp_path):
    model, data = assets
    recipe = "recipes/tiny-cpu.yaml"
    # 1. the documented plain sbatch; scancel once a checkpoint exists: nothing survives
    run_b, out = tmp_path / "b", tmp_path / "job-b.out"
    job_b = cluster.sbatch(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            f"--output={out}",
            "launch/slurm/run.sbatch",
            recipe,
            *_overrides(run_b, model, data, "total_steps=1000"),
        ],
        env=_job_env(),
        cwd=ROOT,
    )
    try:
        poll(
            lambda: list((run_b / "checkpoints").glob("iter_*/areal_meta.json")),
            JOB_TIMEOUT_S,
            f"job {job_b}: first checkpoint",
            interval_s=1.0,
        )
    except TimeoutError:
        cluster.run(["scancel", str(job_b)], check=False)
        pytest.fail(
            f"job {job_b} wrote no checkpoint:\n{_tail(out)}\n"
            f"{_tail(run_b / 'logs' / 'trainer.log')}"
        )
    running = " ".join(cmd for _, cmd in job_processes(job_b))
    for part in ("areal_mega.launch.local", "areal_mega.inference.server", "areal_mega.trainer"):
        assert part in running, running
    cluster.run(["scancel", str(job_b)])
    job = _finished(cluster, job_b, out)
    assert job["JobState"] == "CANCELLED"
    assert job_processes(job_b) == []  # every process of the job is gone
    done = max(m["step"] for m in _metrics(run_b))

    # 2. resubmitting the same run (recover=auto) through the submit wrapper, which reads the
    # recipe: --nodes=1 and no --gpus-per-node for device=cpu; the job completes, resumed
    # from the latest checkpoint
    out = tmp_path / "job-c.out"
    job_c = cluster.sbatch(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.slurm_submit",
            "--parsable",
            f"--output={out}",
            recipe,
            *_overrides(run_b, model, data, f"total_steps={done + 1}"),
        ],
        env=_job_env(),
        cwd=ROOT,
    )
    job = _finished(cluster, job_c, out)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", _tail(out)
    assert job["NumNodes"] == "1" and "gres/gpu" not in job.get("TRES", "")
    python = ROOT / ".venv/bin/python" if (ROOT / ".venv/bin/python").exists() else sys.executable
    assert f"[run.sbatch] python: {python}" in out.read_text()
    assert "resumed from" in (run_b / "logs" / "trainer.log").read_text()
    assert [m["step"] for m in _metrics(run_b)] == list(range(1, done + 2)), _tail(out)


def test_multi_node_branch_on_two_nodes(cluster, assets, tmp_path):
    model, data = assets
    port, master = free_ports(2)
    run, out = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(FIX)
    env.update(
        AREAL_MEGA_TRAINER_MODULE="fake_trainer",
        MASTER_PORT=str(master),
        AREAL_MEGA_ROLLOUT_WORKER_MODULE="fake_rollout_worker",
        FAKE_PID_DIR=str(tmp_path),
        SERVER_WAIT_S="300",
    )
    # the server serves the network (--serve-node): its key from a private file, not argv
    key_file = tmp_path / "api.key"
    key_file.write_text("slurm-test-key")
    key_file.chmod(0o600)
    env["AREAL_ROLLOUT_API_KEY_FILE"] = str(key_file)
    # a layout with whole nodes per role: rollout server on node 0, trainer on node 1
    job_id = cluster.sbatch(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            f"--output={out}",
            "launch/slurm/run.sbatch",
            "recipes/tiny-cpu.yaml",
            *_overrides(
                run,
                model,
                data,
                "cluster.device=cuda",
                "cluster.n_nodes=2",
                "cluster.n_gpus_per_node=1",
                "allocation=local:d1+megatron:d1",
                f"cluster.server_base_port={port}",
            ),
        ],
        env=env,
        cwd=ROOT,
    )
    job = _finished(cluster, job_id, out)
    text = out.read_text()
    assert job["JobState"] == "COMPLETED" and job["NumNodes"] == "2", text
    assert "nodes: n1 n2 (addresses 127.0.0.1 127.0.0.1)" in text
    assert f"127.0.0.1:{port} ready" in text  # probed GET /health
    assert "relaunch 1/2" in text and "resumed OK from iter_0000003" in text
    assert f"servers ['127.0.0.1:{port}']" in text  # the trainer step joined it
    assert "training finished" in text
    logs = list((run / "logs").glob("node0-*/rollout0.log"))
    assert logs, "the rollout step did not run launch.local --serve-node 0"
    assert job_processes(job_id) == []  # rollout step stopped at exit


def test_vllm_branch_without_its_interpreter_fails_before_any_step(cluster, assets, tmp_path):
    """rollout.backend=vllm on two nodes with no vLLM interpreter: the batch script stops with
    what to do before it starts any step (no vLLM is started here either way)."""
    model, data = assets
    missing = tmp_path / "no-venv" / "bin" / "python"
    run, out = tmp_path / "run", tmp_path / "job.out"
    job_id = cluster.sbatch(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            f"--output={out}",
            "launch/slurm/run.sbatch",
            "recipes/tiny-cpu.yaml",
            *_overrides(
                run,
                model,
                data,
                "cluster.device=cuda",
                "cluster.n_nodes=2",
                "cluster.n_gpus_per_node=1",
                "rollout.backend=vllm",
                "allocation=vllm:d1+megatron:d1",
                f"rollout.vllm.python={missing}",
            ),
        ],
        env=_job_env(),
        cwd=ROOT,
    )
    job = _finished(cluster, job_id, out)
    text = out.read_text()
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", text
    assert "(1 vllm servers)" in text
    assert f"rollout.vllm.python: {str(missing)!r} does not exist" in text
    assert "make vllm-env" in text and "no step started" in text
    assert not (run / "logs").exists()  # no rollout step ran

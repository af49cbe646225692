"""launch/torchrun.sh under a real torchrun, and launch/slurm/run.sbatch's flow with stub
``scontrol`` / ``srun`` / ``curl`` commands (no Slurm here): node split, server addresses,
master address, bounded trainer relaunch, cleanup of the rollout step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.common.net import free_port
from tests.helpers.vllm_env import vllm_python

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures_launch"


def test_scripts_parse():
    for script in ("launch/torchrun.sh", "launch/slurm/run.sbatch", "launch/slurm/ray.sbatch"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
        assert os.access(ROOT / script, os.X_OK)


@pytest.mark.parametrize("backend", ["local", "vllm"])
def test_torchrun_sh_joins_external_servers(tmp_path, backend):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "AREAL_MEGA_TRAINER_MODULE": "fake_trainer",
        "FAKE_TRAINER_MODE": "echo",
        "PYTHONPATH": os.pathsep.join([str(FIX), str(ROOT)]),
        "MASTER_PORT": str(free_port()),
        "CUDA_VISIBLE_DEVICES": "",
        "AREAL_MEGA_ROLLOUT_WORKER_MODULE": "fake_rollout_worker",
        "FAKE_PID_DIR": str(tmp_path),
    }
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "launch/torchrun.sh"),
            "recipes/tiny-cpu.yaml",
            "allocation=megatron:d2",
            "rollout.server_addrs=10.1.2.3:30000",
            f"rollout.backend={backend}",
            f"logging.run_dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"rollout backend {backend}" in r.stderr
    # each rank's line from its own file (the two ranks' stdout lines can interleave)
    lines = [(tmp_path / f"echo-rank{k}.txt").read_text() for k in (0, 1)]
    assert all(x.startswith(f"ECHO rank={k} world=2") for k, x in enumerate(lines)), lines
    assert "rollout.server_addrs=10.1.2.3:30000" in lines[0] and "'--config'" in lines[0]
    assert "worker serving ['10.1.2.3:30000']" in r.stdout  # started beside rank 0 ...
    assert not _alive(int((tmp_path / "worker.pid").read_text()))  # ... and stopped after


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
        return False
    os.kill(pid, 9)  # do not leave it behind if the assertion fails
    return True


SRUN_STUB = """#!/usr/bin/env bash
echo "SRUN MASTER_ADDR=${MASTER_ADDR:-} NNODES=${NNODES:-} $*" >> "$STUB_LOG"
case "$*" in
  *--serve-node*) echo $$ > "$STUB_DIR/serve.pid"; exec sleep 60 ;;
  *torchrun.sh*)
    n=$(cat "$STUB_DIR/count" 2>/dev/null || echo 0); echo $((n + 1)) > "$STUB_DIR/count"
    if [[ $n -lt 1 ]]; then exit 7; fi; exit 0 ;;
esac
"""


def _run_sbatch_with_stubs(tmp_path, *overrides):
    """run.sbatch on two stub nodes (nodeA, nodeB) with the 7B recipe; returns the finished
    process and the stub log path (srun and curl calls)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'nodeA\\nnodeB\\n'\n")
    (stubs / "srun").write_text(SRUN_STUB)
    (stubs / "curl").write_text('#!/usr/bin/env bash\necho "CURL $*" >> "$STUB_LOG"\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    log = tmp_path / "stub.log"
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "SLURM_JOB_NODELIST": "node[A-B]",
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "STUB_LOG": str(log),
        "STUB_DIR": str(tmp_path),
    }
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "launch/slurm/run.sbatch"),
            str(ROOT / "recipes/qwen2.5-7b-math.yaml"),
            f"logging.run_dir={tmp_path / 'run'}",
            *overrides,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r, log


def test_sbatch_flow_with_stubs(tmp_path):
    r, log = _run_sbatch_with_stubs(tmp_path)
    out = log.read_text()
    assert r.returncode == 0, r.stdout + r.stderr + out
    sruns = [x for x in out.splitlines() if x.startswith("SRUN")]
    serve = [x for x in sruns if "--serve-node" in x]
    train = [x for x in sruns if "torchrun.sh" in x]
    assert len(serve) == 1 and "--nodelist=nodeA" in serve[0]
    assert len(train) == 2  # failed once (exit 7), relaunched, then finished
    addrs = ",".join(f"nodeA:{30000 + k}" for k in range(8))
    for t in train:
        assert "--nodelist=nodeB" in t and "MASTER_ADDR=nodeB NNODES=1" in t
        assert f"rollout.server_addrs={addrs}" in t
    # servers are probed for liveness on /health (SGLang's /health_generate 503s while paused)
    curls = [x for x in out.splitlines() if x.startswith("CURL")]
    assert len(curls) == 8 and all(
        x.endswith(":%d/health" % (30000 + k)) for k, x in enumerate(curls)
    ), curls
    assert "relaunch 1/3" in r.stderr
    assert "training finished" in r.stdout
    # the rollout step (a sleeping stub) was stopped by the EXIT trap
    assert not _alive(int((tmp_path / "serve.pid").read_text()))
    assert "(8 sglang servers)" in r.stdout and "vLLM" not in r.stdout


VLLM = ["rollout.backend=vllm", "allocation=vllm:d2t4+megatron:d4t2"]


def test_sbatch_vllm_branch_checks_the_interpreter_then_serves(tmp_path):
    """The vLLM interpreter is checked once on the batch host; the rollout step is
    launch.local --serve-node with the same overrides (it builds the vLLM commands)."""
    python = vllm_python()
    r, log = _run_sbatch_with_stubs(tmp_path, *VLLM, f"rollout.vllm.python={python}")
    out = log.read_text()
    assert r.returncode == 0, r.stdout + r.stderr + out
    assert "(2 vllm servers)" in r.stdout and "weight-update group world 9" in r.stdout
    assert "[run.sbatch] rollout servers: vLLM 0.32." in r.stdout and python in r.stdout
    serve = [x for x in out.splitlines() if x.startswith("SRUN") and "--serve-node" in x]
    assert len(serve) == 1 and "--nodelist=nodeA" in serve[0]
    assert all(o in serve[0] for o in VLLM) and f"rollout.vllm.python={python}" in serve[0]
    curls = [x for x in out.splitlines() if x.startswith("CURL")]
    assert [x.rsplit(" ", 1)[1] for x in curls] == [
        "http://nodeA:30000/health",
        "http://nodeA:30001/health",
    ]
    train = [x for x in out.splitlines() if x.startswith("SRUN") and "torchrun.sh" in x]
    assert train and all("rollout.server_addrs=nodeA:30000,nodeA:30001" in t for t in train)


def test_sbatch_vllm_branch_stops_before_any_step_without_the_interpreter(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    r, log = _run_sbatch_with_stubs(tmp_path, *VLLM, f"rollout.vllm.python={missing}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"rollout.vllm.python: {str(missing)!r} does not exist" in r.stderr
    assert "make vllm-env" in r.stderr and "no step started" in r.stderr
    assert not log.exists() or "SRUN" not in log.read_text()  # no srun, no curl


def test_sbatch_requests_no_gpus_and_uses_the_repo_venv(tmp_path):
    """No hard-coded generic resource (a CPU cluster rejects it); PYTHON defaults to the
    repository's .venv (here a stand-in repository whose .venv/bin/python runs this one)."""
    sbatch_lines = [
        x
        for x in (ROOT / "launch/slurm/run.sbatch").read_text().splitlines()
        if x.startswith("#SBATCH")
    ]
    assert sbatch_lines and not any("gpu" in x or "gres" in x for x in sbatch_lines)
    repo, stubs = tmp_path / "repo", tmp_path / "bin"
    (repo / ".venv" / "bin").mkdir(parents=True)
    stubs.mkdir()
    venv_python = repo / ".venv" / "bin" / "python"
    venv_python.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} "$@"\n')
    (stubs / "scontrol").write_text("#!/usr/bin/env bash\necho node1\n")
    (stubs / "srun").write_text('#!/usr/bin/env bash\necho "SRUN $*" >> "$STUB_LOG"\n')
    for f in (venv_python, stubs / "scontrol", stubs / "srun"):
        f.chmod(0o755)
    log = tmp_path / "stub.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(
        PATH=f"{stubs}:{os.environ['PATH']}",
        PYTHONPATH=str(ROOT),
        SLURM_JOB_NODELIST="node1",
        SLURM_SUBMIT_DIR=str(repo),
        STUB_LOG=str(log),
    )
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "launch/slurm/run.sbatch"),
            str(ROOT / "recipes/tiny-cpu.yaml"),
            f"logging.run_dir={tmp_path}/r",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"[run.sbatch] python: {venv_python}" in r.stdout
    # single-node layout: one srun step running launch.local with that interpreter
    assert log.read_text().startswith(
        f"SRUN --nodes=1 --ntasks=1 {venv_python} -m areal_mega.launch.local --config"
    )


def test_submit_wrapper_takes_resources_from_the_recipe():
    from areal_mega.config import load_config
    from areal_mega.launch.slurm_submit import sbatch_command

    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        cfg = load_config(recipe)
        argv = sbatch_command(cfg, str(recipe), ["seed=2"], ["--partition=p"])
        assert argv[0] == "sbatch"
        assert argv[-3:] == [str(ROOT / "launch/slurm/run.sbatch"), str(recipe), "seed=2"]
        nodes = 1 if cfg.cluster.device == "cpu" else cfg.cluster.n_nodes
        assert f"--nodes={nodes}" in argv and "--partition=p" in argv
        gpus = [a for a in argv if a.startswith("--gpus-per-node")]
        if cfg.cluster.device == "cpu":
            assert gpus == [], argv
        else:
            assert gpus == [f"--gpus-per-node={cfg.cluster.n_gpus_per_node}"], argv
    # the shell entry point, as documented
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "launch/slurm/submit.sh"),
            "--dry-run",
            "--time=1:00:00",
            "recipes/qwen2.5-7b-math.yaml",
            "seed=3",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("sbatch --nodes=2 --gpus-per-node=8 --time=1:00:00 ")
    assert r.stderr.rstrip().endswith("run.sbatch recipes/qwen2.5-7b-math.yaml seed=3")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.slurm_submit",
            "--dry-run",
            "recipes/tiny-cpu.yaml",
            "cluster.n_nodes=0",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "cluster.n_nodes" in bad.stderr


RAY_SRUN_STUB = """#!/usr/bin/env bash
echo $$ >> "$STUB_DIR/ray-steps.pid"
echo "SRUN RAY_ADDRESS=${RAY_ADDRESS:-} $*" >> "$STUB_LOG"
exec sleep 60
"""
RAY_PYTHON_STUB = """#!/usr/bin/env bash
echo "PY RAY_ADDRESS=${RAY_ADDRESS:-} PYTHONPATH=${PYTHONPATH:-} $*" >> "$STUB_LOG"
case "$*" in
  *--wait-nodes*)  # as the real one: until every node's step has joined (bounded)
    for _ in $(seq 300); do
      [[ $(grep -c '^SRUN' "$STUB_LOG" 2>/dev/null) -ge 3 ]] && exit 0; sleep 0.1
    done; exit 2 ;;
  *) exit "${RUN_RC:-0}" ;;
esac
"""


def _ray_sbatch(tmp_path, *overrides, rc=0):
    """launch/slurm/ray.sbatch on three stub nodes: ``srun`` records its step and sleeps (a
    ``ray start --block``), ``python`` records its call; returns the result and the log."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        'if [[ $1 == show ]]; then printf "n1\\nn2\\nn3\\n"\n'
        'else echo "NodeAddr=10.0.0.${4#n}"; fi\n'  # scontrol -o show node nK
    )
    (stubs / "srun").write_text(RAY_SRUN_STUB)
    (stubs / "python").write_text(RAY_PYTHON_STUB)
    for f in stubs.iterdir():
        f.chmod(0o755)
    log = tmp_path / "stub.log"
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "PYTHON": str(stubs / "python"),
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "STUB_LOG": str(log),
        "STUB_DIR": str(tmp_path),
        "RUN_RC": str(rc),
    }
    r = subprocess.run(
        ["bash", str(ROOT / "launch/slurm/ray.sbatch"), "recipes/tiny-cpu.yaml", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r, log


def test_ray_sbatch_starts_a_ray_cluster_then_the_launcher(tmp_path):
    r, log = _ray_sbatch(tmp_path, "total_steps=3", rc=3)
    out = log.read_text()
    assert r.returncode == 3, r.stdout + r.stderr + out  # the launcher's exit code
    lines = out.splitlines()
    sruns = [x for x in lines if x.startswith("SRUN")]
    head = [x for x in sruns if "--head" in x]
    assert len(head) == 1 and "--nodelist=n1" in head[0]
    assert "start --head --block --node-ip-address=10.0.0.1 --port=6379" in head[0]
    joins = [x for x in sruns if "--address=10.0.0.1:6379" in x]
    assert sorted(x.split("--nodelist=")[1].split()[0] for x in joins) == ["n2", "n3"]
    py = [x for x in lines if x.startswith("PY")]
    assert len(py) == 2 and all("RAY_ADDRESS=10.0.0.1:6379" in x for x in py)
    assert f"PYTHONPATH={ROOT}" in py[0]  # every node imports areal_mega from the checkout
    assert "-m areal_mega.launch.ray --config recipes/tiny-cpu.yaml --wait-nodes 3" in py[0]
    assert py[1].endswith("-m areal_mega.launch.ray --config recipes/tiny-cpu.yaml total_steps=3")
    assert "launch.ray exited with 3" in r.stdout
    # the Ray steps (sleeping stubs) were stopped by the EXIT trap
    pids = [int(x) for x in (tmp_path / "ray-steps.pid").read_text().split()]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_ray_sbatch_refuses_the_api_key_on_the_command_line(tmp_path):
    r, log = _ray_sbatch(tmp_path, "rollout.api_key=secret")
    assert r.returncode == 2 and "AREAL_ROLLOUT_API_KEY_FILE" in r.stderr
    assert not log.exists()

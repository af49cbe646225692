"""``launch.ray`` where users run it: submitted with ``ray job submit`` to a cluster started
with ``ray start`` (a head with the dashboard that takes jobs, and a second node on this
machine, one cluster for both tests), and what it trains compared with ``launch.local``.

* the tiny recipe with seeded sampling (``rollout.seeded_sampling``) at eta 0, submitted as a
  Ray job: the job succeeds, its processes land on both nodes, and every step equals the step
  ``launch.local`` trains from the same command and seed: the same rewards and response
  lengths, token counts and versions, the loss, gradient norm and entropy within float noise
  (the reward curve is the same curve, not one within noise of the other). Ray only places
  and starts the processes; it is not in the data path.
* a node whose view of the run directory is not the driver's (the second node runs in a
  mount namespace of its own, a tmpfs over the run's parent folder): the launcher stops before
  anything starts with one message naming that node. Skipped, saying why, where this machine
  does not allow a mount namespace.

The cluster is stopped by signalling the ``ray start --block`` processes (never ``ray stop``,
which would stop every Ray cluster on the machine, the other test modules' included).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from areal_mega.common.net import free_ports
from tests.helpers.local_runs import _finish, _launch, _metrics, run_overrides

pytest.importorskip("ray.dashboard")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
STEPS = 6
COMMON = (
    f"total_steps={STEPS}",
    "recover=off",
    "rollout.max_head_offpolicyness=0",
    "rollout.seeded_sampling=true",
    "rollout.reward_fn=areal_mega.rewards:char_match_reward",
    "optimizer.lr=1e-2",
    "optimizer.warmup_steps=0",
)
#: the same when the same samples were trained: counts exactly, means and spreads up to the
#: order they were summed in (a group's samples arrive in either order)
EXACT = ("n_tokens_total", "version")
SAME = ("reward/mean", "reward/std", "response_len/mean")
#: the same up to float summation order in the trainer
CLOSE = ("loss", "grad_norm", "entropy")


def _node_ports(n: int = 6) -> list:
    names = (
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
    )
    return [f"{k}={p}" for k, p in zip(names, free_ports(n))]


class RayStartCluster:
    """A head (``ray start --head --block`` with the dashboard) and more nodes (``ray start
    --address --block``), one CPU each, every port chosen free, in process groups of their
    own; :meth:`stop` signals them."""

    def __init__(self, tmp: Path, env: dict):
        self.tmp, self.env, self.procs = tmp, env, []
        # Ray's socket paths under it must stay within AF_UNIX's 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        gcs, self.dash, client = free_ports(3)
        self.address = f"127.0.0.1:{gcs}"
        self.dashboard = f"http://127.0.0.1:{self.dash}"
        self._start(
            "head",
            [
                "--head",
                f"--port={gcs}",
                "--node-ip-address=127.0.0.1",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dash}",
                f"--ray-client-server-port={client}",
                f"--temp-dir={self.temp_dir}",
            ],
        )

    def _start(self, name: str, args: list, wrap: tuple = ()) -> None:
        log = open(self.tmp / f"ray-{name}.log", "w")
        cmd = [*wrap, RAY, "start", "--block", "--num-cpus=1", "--disable-usage-stats"]
        cmd += ["--min-worker-port=0", "--max-worker-port=0"]  # workers: ports the OS picks
        self.procs.append(
            subprocess.Popen(
                cmd + args + _node_ports(),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def add_node(self, name: str, wrap: tuple = ()) -> None:
        self._start(name, [f"--address={self.address}", "--node-ip-address=127.0.0.1"], wrap)

    def wait_jobs_api(self, timeout: float = 180.0) -> None:
        """Until the dashboard's job API answers."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert all(p.poll() is None for p in self.procs), self.logs()
            assert time.monotonic() < deadline, "the Ray dashboard did not answer\n" + self.logs()
            time.sleep(0.5)

    def wait_nodes(self, n: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(f"{self.dashboard}/nodes?view=summary", timeout=10) as r:
                summary = json.load(r)["data"]["summary"]
            alive = [x for x in summary if x.get("raylet", {}).get("state") == "ALIVE"]
            if len(alive) >= n:
                return
            assert time.monotonic() < deadline, f"{len(alive)} of {n} nodes\n" + self.logs()
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f.read_text()[-1500:] for f in sorted(self.tmp.glob("ray-*.log")))

    def stop(self) -> None:
        """SIGTERM to each node's process group (``ray start --block``, GCS, raylet,
        dashboard, workers), SIGKILL to what is left after 5 s."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("key") / "api_key"
    f.write_text("ray-job-test-key-0123456789abcdef")
    f.chmod(0o600)
    return f


def _env(key_file) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return dict(
        env,
        PYTHONPATH=str(ROOT),
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        AREAL_ROLLOUT_API_KEY_FILE=str(key_file),
    )


def _can_unshare_mounts() -> str:
    """'' when this process may mount a tmpfs in a mount namespace of its own (what the
    second node's wrapper does), else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", d],
            capture_output=True,
            text=True,
        )
    return "" if r.returncode == 0 else f"a tmpfs in a mount namespace refused: {r.stderr.strip()}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, key_file):
    """A head and a second node, one CPU each. The second runs in a mount namespace of its
    own with a tmpfs over ``private`` where the machine allows one (``no_mask_reason`` says
    why not where it does not): it sees the run directories outside ``private`` as the driver
    does, and none inside."""
    tmp = tmp_path_factory.mktemp("ray_start")
    private = tmp / "private"
    private.mkdir()
    c = RayStartCluster(tmp, _env(key_file))
    c.private, c.no_mask_reason = private, _can_unshare_mounts()
    try:
        c.wait_jobs_api()
        wrap = ()
        if not c.no_mask_reason:
            wrap = (
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'mount -t tmpfs tmpfs "{private}" && exec "$0" "$@"',
            )
        c.add_node("node2", wrap)
        c.wait_nodes(2)
        yield c
    finally:
        c.stop()
    left = [
        " ".join(p.info["cmdline"] or [])[:200]
        for p in psutil.process_iter(["cmdline"])
        if c.temp_dir in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, left


def test_a_submitted_job_trains_what_launch_local_trains(assets, tmp_path, cluster, key_file):
    model, data = assets
    ray_run = tmp_path / "ray_run"
    entry = [  # the driver finds areal_mega through PYTHONPATH, set on `ray start`
        sys.executable,
        "-m",
        "areal_mega.launch.ray",
        "--config",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        *run_overrides(ray_run, model, data),
        *COMMON,
        "--placement-timeout=120",
    ]
    job = subprocess.run(
        [RAY, "job", "submit", f"--address={cluster.dashboard}", "--", *entry],
        env=_env(key_file),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in out, out[-4000:] + cluster.logs()
    sup = (ray_run / "logs" / "supervisor.log").read_text()
    nodes = {line.split(", node ", 1)[1][:8] for line in sup.splitlines() if ", node " in line}
    assert len(nodes) == 2, sup  # one CPU a node: the server and the trainer apart
    local_run = tmp_path / "local_run"
    rc, out = _finish(_launch(local_run, model, data, *COMMON), timeout=300)
    assert rc == 0, out[-3000:]
    ray_rows, local_rows = _metrics(ray_run), _metrics(local_run)
    assert (
        [r["step"] for r in ray_rows] == [r["step"] for r in local_rows] == [*range(1, STEPS + 1)]
    )
    for a, b in zip(ray_rows, local_rows):
        assert {k: a[k] for k in EXACT} == {k: b[k] for k in EXACT}, a["step"]
        for k in SAME:
            assert abs(a[k] - b[k]) <= 1e-9, (a["step"], k, a[k], b[k])
        for k in CLOSE:
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (a["step"], k, a[k], b[k])
    rewards = [r["reward/mean"] for r in local_rows]
    print("reward per step (both launchers):", [round(x, 4) for x in rewards])


def test_a_node_that_does_not_see_the_run_directory_is_named(assets, cluster, key_file):
    if cluster.no_mask_reason:
        pytest.skip(cluster.no_mask_reason)
    model, data = assets
    run = cluster.private / "run"
    rc, out = _finish(
        _launch(
            run,
            model,
            data,
            *COMMON,
            "--placement-timeout=120",
            module="areal_mega.launch.ray",
            env={
                "RAY_ADDRESS": cluster.address,
                "PYTHONPATH": str(ROOT),
                "AREAL_ROLLOUT_API_KEY_FILE": str(key_file),
            },
        ),
        timeout=300,
    )
    assert rc == 2, out[-3000:]
    assert f"the run directory {run} is not on storage every node sees" in out, out[-3000:]
    assert "put logging.run_dir (and checkpoint.dir) on a shared filesystem" in out
    assert "Traceback" not in out
    assert not (run / "metrics.jsonl").exists()

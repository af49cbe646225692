"""The Ray placement planner (pure): placement groups of a layout, their nodes, the shortage
message; ``launch.ray --dry-run``, the import without Ray, and the reaper that stops a process
tree whose actor died (no cluster needed)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_mega.launch.plan import plan_layout
from areal_mega.launch.ray_placement import (
    PlacementShortage,
    assign_nodes,
    describe_placement,
    plan_placement,
    ray_options,
    server_group,
)
from areal_mega.parallel.allocation import parse_allocation

ROOT = Path(__file__).resolve().parents[1]


def _layout(alloc, n_nodes=1, gpus=8, device="cuda"):
    return plan_layout(parse_allocation(alloc), device=device, n_nodes=n_nodes, gpus_per_node=gpus)


def test_one_node_gpu_layout_groups_and_bundles():
    p = plan_placement(_layout("sglang:d2t2+megatron:d4"), run="r", cpus_per_server=2)
    assert [g.name for g in p.groups] == ["r-rollout0", "r-rollout1", "r-trainer"]
    assert [g.strategy for g in p.groups] == ["STRICT_PACK"] * 3
    assert p.group("r-rollout0").bundles[0].resources == {"CPU": 2, "GPU": 2}
    (tb,) = p.group("r-trainer").bundles
    # the rollout worker rides on the trainer's first bundle (its ipc:// sockets)
    assert [s.process for s in tb.slots] == ["trainer", "rollout_worker"]
    assert tb.resources == {"CPU": 4, "GPU": 4}
    assert p.total() == {"CPU": 8, "GPU": 8}
    assert [x[0] for x in p.processes()] == ["rollout0", "rollout1", "trainer", "rollout_worker"]


def test_multi_node_trainer_spreads_one_bundle_per_node():
    lay = _layout("sglang:d4t2+megatron:d4t2p2", n_nodes=3, gpus=8)
    p = plan_placement(lay, run="r", cpus_per_trainer_rank=2, worker_cpus=1)
    t = p.group("r-trainer")
    assert t.strategy == "STRICT_SPREAD" and len(t.bundles) == 2
    assert [s.process for s in t.bundles[0].slots] == ["trainer@0", "rollout_worker"]
    assert [s.process for s in t.bundles[1].slots] == ["trainer@1"]
    assert t.bundles[0].resources == {"CPU": 17, "GPU": 8}
    assert t.bundles[1].resources == {"CPU": 16, "GPU": 8}
    nodes = [(f"n{i}", {"CPU": 64, "GPU": 8}) for i in range(3)]
    where = assign_nodes(p, nodes)
    assert where[("r-trainer", 0)] != where[("r-trainer", 1)]  # distinct nodes
    # the servers (2 GPUs each, 4 of them) share the node the trainer left
    servers = {where[(f"r-rollout{i}", 0)] for i in range(4)}
    assert len(servers) == 1 and servers.isdisjoint({where[("r-trainer", k)] for k in (0, 1)})
    text = describe_placement(p, where)
    assert "trainer@1: r-trainer bundle 1 {CPU 16, GPU 8} on n" in text


def test_cpu_layout_asks_for_cpus_only_and_sft_has_no_worker():
    lay = _layout("local:d2+megatron:d2", device="cpu")
    p = plan_placement(lay, run="r", rl=False, cpus_per_server=3)
    assert p.total() == {"CPU": 8}
    assert "rollout_worker" not in [x[0] for x in p.processes()]


def test_shortage_names_what_is_needed_and_what_the_cluster_has():
    p = plan_placement(_layout("sglang:d2t4+megatron:d8", n_nodes=2), run="r")
    nodes = [("a", {"CPU": 32, "GPU": 8}), ("b", {"CPU": 32, "GPU": 4})]
    with pytest.raises(PlacementShortage) as e:
        assign_nodes(p, nodes)
    msg = str(e.value)
    assert "needs CPU 10, GPU 16 in 3 bundle(s) (the largest {CPU 8, GPU 8}, on one node)" in msg
    assert "the cluster has CPU 64, GPU 12 on 2 node(s): a: CPU 32, GPU 8; b: CPU 32, GPU 4" in msg


def test_strict_spread_needs_distinct_nodes_even_when_one_has_room():
    lay = _layout("sglang:d1+megatron:d8", n_nodes=3, gpus=4)
    p = plan_placement(lay, run="r")
    # one big node could hold 8 GPUs, but torchrun wants one agent per node
    with pytest.raises(PlacementShortage, match="bundle 1 of r-trainer does not fit"):
        assign_nodes(p, [("big", {"CPU": 99, "GPU": 16}), ("small", {"CPU": 99, "GPU": 1})])


def test_custom_resources_and_scaled_server_group():
    g = server_group("r", 7, 2, 4, "cuda")
    assert g.name == "r-rollout7" and g.bundles[0].resources == {"CPU": 4, "GPU": 2}
    assert server_group("r", 0, 2, 1, "cpu").bundles[0].resources == {"CPU": 1}
    assert ray_options({"CPU": 2, "GPU": 1, "node_a": 1}) == {
        "num_cpus": 2,
        "num_gpus": 1,
        "resources": {"node_a": 1},
    }
    assert ray_options({}) == {"num_cpus": 0, "num_gpus": 0, "resources": {}}


def _dry_run(*extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.ray",
            "--config",
            str(ROOT / "recipes" / "tiny-cpu.yaml"),
            "--dry-run",
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_dry_run_prints_placement_and_memory():
    r = _dry_run(
        "--device",
        "cuda",
        "allocation=sglang:d2t2+megatron:d4",
        "cluster.n_nodes=2",
        "cluster.n_gpus_per_node=4",
        "rollout.backend=sglang",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "trainer memory per GPU" in out  # launch.local's memory arithmetic
    assert "ray placement on cluster.n_nodes=2 planned node(s)" in out
    assert "rollout0: tiny-cpu-" in out and "{CPU 1, GPU 2} on node" in out
    assert "trainer: tiny-cpu-" in out and "{CPU 4, GPU 4} on node" in out
    # the trainer's second node (STRICT_SPREAD) and the rollout worker in its first bundle
    r = _dry_run(
        "--device",
        "cuda",
        "allocation=sglang:d2t2+megatron:d8",
        "cluster.n_nodes=3",
        "cluster.n_gpus_per_node=4",
        "rollout.backend=sglang",
    )
    assert r.returncode == 0, r.stderr
    assert "rollout_worker: tiny-cpu-" in r.stdout and "trainer@1: tiny-cpu-" in r.stdout


def test_without_ray_the_import_says_how_to_install_it():
    code = "import sys; sys.modules['ray'] = None; import areal_mega.launch.ray"
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == (
        "ImportError: areal_mega.launch.ray needs Ray, an optional extra: pip install -e .[ray]"
    ), r.stderr


_TREE = """
import subprocess, sys, time
# a child (torchrun's stand-in) whose own child sits in a session of its own (a rank)
code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \\
       "'import time; time.sleep(600)'], start_new_session=True); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", code])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_reaper_stops_the_whole_tree_once_its_parent_is_gone(tmp_path):
    """The actor (here a plain process) is SIGKILLed: its child and the child's child in
    another session are stopped by the reaper; a tree whose parent lives is left alone."""
    import psutil

    parent = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    tree = [psutil.Process(child)]
    deadline = time.monotonic() + 60
    while len(tree) < 2 and time.monotonic() < deadline:  # until the grandchild has started
        tree = [psutil.Process(child)] + psutil.Process(child).children(recursive=True)
        time.sleep(0.05)
    assert len(tree) == 2
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    reaper = [sys.executable, "-m", "areal_mega.launch.reaper", "--detach"]
    try:
        # detached (as launch.ray starts it): the command returns at once, the watcher stays
        r = subprocess.run(reaper + [str(parent.pid), str(child), "5"], env=env, timeout=60)
        assert r.returncode == 0
        assert all(p.is_running() for p in tree)  # the parent lives: it only watches
        parent.kill()
        parent.wait()
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, alive
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in tree:
            if p.is_running():
                p.kill()

"""The trainer mesh (areal_mega/parallel/mesh.py) gives back what it takes: a process that
builds mesh after mesh (a re-mesh, a test of layouts) keeps a constant number of threads,
because destroying a mesh destroys megatron's process groups, not only its references to them
(each gloo group keeps threads alive, some busy in their TCP loops); a mesh built and
destroyed while another is in use (a converter's inside a trainer) leaves the other's groups
working. The same holds with an engine trained on each mesh: megatron's MoE token dispatchers
keep the last routing probabilities' autograd graph, a reference cycle through C++ autograd
nodes that kept every trained MoE engine (and its groups) alive
(areal_mega/engine/dispatcher_graph.py)."""

import json

import pytest

from areal_mega.common.net import free_port
from tests.helpers.multirank import run_ranks
from tests.helpers.workers import worker_cmd


@pytest.mark.timeout(300)
def test_meshes_built_one_after_another_do_not_accumulate_threads(tmp_path):
    port, n = free_port(), 5
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    ranks = run_ranks(
        [worker_cmd("mesh_worker", r, 2, port, outs[r], n) for r in range(2)], timeout=240
    )
    for (code, log), out in zip(ranks, outs):
        assert code == 0, log[-3000:]
        threads = json.loads(out.read_text())["threads"]
        assert len(threads) == n
        # without the groups destroyed: about 60 more threads with every mesh
        assert max(threads[1:]) - threads[1] <= 4, threads
        assert json.loads(out.read_text())["outer_sum"] == 2.0


@pytest.mark.timeout(400)
def test_engines_trained_on_mesh_after_mesh_are_freed_with_their_groups(tmp_path):
    port, n = free_port(), 4
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    ranks = run_ranks(
        [worker_cmd("mesh_worker", r, 2, port, outs[r], n, "engines") for r in range(2)],
        timeout=340,
    )
    for (code, log), out in zip(ranks, outs):
        assert code == 0, log[-3000:]
        res = json.loads(out.read_text())
        assert res["freed"] == [True] * n, res  # each MoE engine's model, once dropped
        # without the dispatchers' graphs released: about 80 more threads with every engine
        assert max(res["threads"][1:]) - res["threads"][1] <= 4, res["threads"]

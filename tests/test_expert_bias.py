"""Routed experts' biases are left out of the sequence-parallel gradient sum
(:mod:`areal_mega.models.expert_bias`), and megatron-core still marks them for it.

That the correction gives the right gradients is shown by GPT-OSS's ``tp2sp_etp1`` layout in
tests/test_new_families.py (TP2 with sequence parallelism, the biased experts at expert TP 1):
without it each expert's ``linear_fc2.bias`` gradient there is twice the single rank's."""

import json
import subprocess
import sys

import torch

from areal_mega.models.expert_bias import unmark_expert_biases
from tests.helpers.workers import ROOT, worker_env

#: one process (gloo, world 1): an expert's and a dense RowParallelLinear as megatron builds
#: them for TP 2 with sequence parallelism and the experts at expert TP 1 (the expert layer's
#: TP group is the size-1 expert TP group, so one rank can build it)
PROBE = """
import json, torch
from areal_mega.parallel.allocation import ParallelDims
from areal_mega.parallel.mesh import ParallelMesh
from areal_mega.models.expert_bias import unmark_expert_biases
mesh = ParallelMesh.create(ParallelDims(), timeout_s=60)
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer import TransformerConfig
cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
    tensor_model_parallel_size=2, expert_tensor_parallel_size=1, sequence_parallel=True,
    num_moe_experts=4, add_bias_linear=True, use_cpu_initialization=True)
def linear(is_expert):
    return RowParallelLinear(16, 8, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
        input_is_parallel=True, skip_bias_add=True, is_expert=is_expert,
        tp_group=mesh.pg_collection.expt_tp)
expert, dense = linear(True), linear(False)
out = {"expert_allreduce": expert.bias.allreduce,
       "expert_marked": expert.bias.sequence_parallel}
out["unmarked"] = unmark_expert_biases(expert) + unmark_expert_biases(dense)
out["expert_after"] = expert.bias.sequence_parallel
out["dense_after"] = dense.bias.sequence_parallel
print("PROBE " + json.dumps(out))
mesh.destroy(process_group=True)
"""


def test_upstream_still_marks_expert_biases_and_the_correction_unmarks_them():
    p = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=worker_env(),
    )
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, p.stdout[-2000:] + p.stderr[-2000:]
    got = json.loads(line[0][6:])
    assert got["expert_allreduce"] is False  # reduced over expert DP by megatron's DDP
    assert got["expert_marked"] is True, (
        "megatron-core no longer marks a routed expert's bias sequence_parallel: "
        "areal_mega/models/expert_bias.py can go"
    )
    assert got["unmarked"] == 1 and got["expert_after"] is False
    assert got["dense_after"] is True  # a replicated dense bias keeps its TP sum


def test_unmark_touches_only_marked_expert_parameters():
    m = torch.nn.Module()
    specs = {
        "expert_bias": (False, True),
        "expert_weight": (False, None),
        "dense_bias": (True, True),
        "plain": (None, None),
    }
    for name, (allreduce, sp) in specs.items():
        p = torch.nn.Parameter(torch.zeros(2))
        if allreduce is not None:
            p.allreduce = allreduce
        if sp is not None:
            p.sequence_parallel = sp
        m.register_parameter(name, p)
    assert unmark_expert_biases(m) == 1
    assert m.expert_bias.sequence_parallel is False and m.dense_bias.sequence_parallel is True
    assert not hasattr(m.expert_weight, "sequence_parallel")
    assert unmark_expert_biases(m) == 0  # once is enough

"""A new model family on the CPU, end to end (issue 28 part 3), one parametrised set per family
of :data:`tests.helpers.new_families.CASES`:

* a tiny HF model made locally converts with ``tools/convert_hf_to_mcore.py`` and back with
  ``tools/convert_mcore_to_hf.py`` bit-exactly;
* the converted checkpoint in the engine gives transformers' logits (unpacked) and per-token
  logprobs (packed micro-batch) within 1e-5 (fp32) on one rank's layout (DP2) and on TP2 / PP2
  (EP2 for MoE), and on DP2 under config variants (Mistral: ``sliding_window: null``;
  Gemma 3: linear RoPE scaling of the full-attention layers); in each, the live weight export
  (what the rollout servers load) is the HF checkpoint bit for bit, every tensor of it;
* those layouts' logprobs and gradients under the production PPO loss equal the single-rank
  reference (tests/helpers/family_worker.py reuses tests/helpers/engine_worker.py);
* (:data:`tests.helpers.new_families.RL_CASES`) 5 RL steps through ``launch.local`` (CPU rollout
  server running the transformers model, rollout worker, trainer): every step's server
  logprobs equal the trainer's (``mismatch`` <= 1e-5, exactly on-policy), and the weights the
  trainer publishes moved away from the initial ones.
"""

import json
import os
from pathlib import Path

import pytest

from areal_mega.common.net import free_port
from areal_mega.data.synthetic import write_task_files
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.convert_worker import compare, load_all
from tests.helpers.family_worker import FAMILIES_ENV
from tests.helpers.local_runs import _finish, _launch, _metrics
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.new_families import CASES, RL_CASES, tiny_spec
from tests.helpers.tool_batch import run_tools
from tests.helpers.workers import worker_cmd

# a family's set: ~80-120 s on 2 cores (Mistral, Gemma 3); the module's first test also runs
# every family's 2-rank checks (its fixture), bounded by run_ranks' timeout there
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[1]
WORKER = "family_worker"  # tests.helpers.family_worker
TOL = 1e-5


def selected_families(session) -> list:
    """The families of this module whose parametrised tests this session runs (``-k``
    deselects the others; every family when none is selected). Other modules' ``family``
    parameters (tests/test_moe_families.py's, collected in the same session) are not ours."""
    names = {
        item.callspec.params["family"]
        for item in session.items
        if item.path == Path(__file__)
        and "family" in getattr(getattr(item, "callspec", None), "params", {})
    }
    return sorted(names & set(CASES)) or sorted(CASES)


@pytest.fixture(scope="module")
def families(request, tmp_path_factory):
    """The selected families' tiny models, converted there and back by our tools, and their
    2-rank checks (one launch): ``{name: {"case", "hf", "hf2", "checks"}}``."""
    work = tmp_path_factory.mktemp("families")
    out, conversions = {}, []
    names = selected_families(request.session)
    for name in names:
        case = CASES[name]
        hf = make_tiny_model(work / name / "hf", **tiny_spec(case))
        mcore, hf2 = work / name / "mcore", work / name / "hf2"
        conversions += [
            ["tools/convert_hf_to_mcore.py", "--hf-dir", hf, "--out", mcore, *case.convert],
            ["tools/convert_mcore_to_hf.py", "--mcore-dir", mcore, "--out", hf2],
        ]
        out[name] = {"case": case, "hf": hf, "hf2": hf2}
    run_tools([[*c, "--no-progress"] for c in conversions])  # one interpreter, all conversions
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env[FAMILIES_ENV] = ",".join(names)
    port = str(free_port())
    ranks = run_ranks(
        [worker_cmd(WORKER, "all", r, 2, port, work) for r in range(2)],
        # each family's layouts take 15-40 s on 2 cores; a hung collective still ends the run
        timeout=120 + 60 * len(names),
        env=env,
        cwd=ROOT,
    )
    checks = rank_results([work / f"all.{r}.json" for r in range(2)], ranks)
    for name in out:
        out[name]["checks"] = [r[name] for r in checks]
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, families):
    """One family's tiny model, its conversions and its 2-rank checks."""
    return families[request.param]


def test_conversion_round_trip_is_bit_exact(family):
    src, back = load_all(family["hf"]), load_all(family["hf2"])
    assert len(src) > 0 and compare(src, back) == []
    config = [json.loads((family[d] / "config.json").read_text()) for d in ("hf", "hf2")]
    assert config[0] == config[1]


def test_engine_equals_transformers(family):
    """Converted checkpoint in every layout (and config variant): logits and packed logprobs
    = transformers'."""
    case = family["case"]
    for layout in ("dp2",) + case.layouts + tuple(f"dp2_{v}" for v in case.config_variants):
        for r in family["checks"]:
            assert r[f"{layout}.hf_packed"] < TOL, (layout, r)
            assert r[f"{layout}.export"] == 0 and r[f"{layout}.export_missing"] == 0, (layout, r)
            if not layout.startswith("pp2"):  # pipelined: no unpacked logits
                assert r[f"{layout}.hf_logits"] < TOL, (layout, r)


def test_layouts_equal_single_rank(family):
    case = family["case"]
    shared = ("pp2_shared_prompts", "tp2_shared_prompts") if case.shared_prompts else ()
    for layout in ("dp2",) + case.layouts + shared:
        for what in ("logprobs", "grads", "loss", "n_tokens", "grad_norm"):
            worst = max(r[f"{layout}.{what}"] for r in family["checks"])
            assert worst < TOL, (layout, what, family["checks"][0])
    if shared:  # micro-batch 1 (a 17-token prompt, 4 samples: 89 tokens) ran its prompt once
        rows = family["checks"][0]["pp2_shared_prompts.model_rows"]
        assert rows[1] < 89 - 17, rows


def test_distributed_optimizer_steps_as_the_regular_one(family):
    """At DP2 one optimizer step of the distributed optimizer (reduce-scattered gradients, Adam
    on each rank's shard, weights gathered) moves every weight as the regular one does."""
    for r in family["checks"]:
        assert r["dp2.distopt_kinds"] == [False, True]
        assert r["dp2.distopt_step"] < 1e-6, r["dp2.distopt_step"]
        assert r["dp2.distopt_step_change"] > 1e-5, r["dp2.distopt_step_change"]


@pytest.mark.parametrize("name", RL_CASES)
def test_rl_steps_on_policy_through_the_cpu_server(tmp_path, name):
    """5 GRPO steps, weights pushed to the server by disk after every step, no staleness:
    every step's samples were generated by the weights the trainer holds, so the server's
    logprobs equal the trainer's recomputation (prompt + answer, 12 tokens, exceed the
    window); the published weights differ from the initial model."""
    model = make_tiny_model(
        tmp_path / "model", **dict(tiny_spec(CASES[name]), **CASES[name].rl_tiny)
    )
    write_task_files(tmp_path / "data", task="reverse", n_train=64, n_test=8)
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run,
            model,
            tmp_path / "data",
            "total_steps=5",
            "recover=off",
            "rollout.max_head_offpolicyness=0",
            "rollout.weight_update=disk",
            "rollout.reward_fn=areal_mega.rewards:char_match_reward",
            "optimizer.lr=1e-2",
            "optimizer.warmup_steps=0",
            *CASES[name].rl_overrides,
        ),
        timeout=300,
    )
    assert rc == 0, out[-3000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["mismatch_tokens"] > 0 and r["mismatch"] <= TOL, (r["step"], r["mismatch"])
    assert any(r.get("grad_norm", 0) > 0 for r in rows)
    published = sorted((run / "weights").glob("v*"))
    assert published, "no weights published"
    moved = compare(load_all(model), load_all(published[-1]))
    assert moved, "the trained weights equal the initial ones"

"""GLM-4 MoE (``glm4_moe``) end to end on the CPU, from a tiny HF model made here: its config
mapped onto megatron-core's router options (and the options megatron cannot reproduce refused),
``tools/convert_hf_to_mcore.py`` and back bit-exactly, EP2 / TP2+SP / PP2 equal to a single rank
(logprobs and grads), the CPU rollout server's sampled logprobs equal to the trainer's forward,
routing replay refused, and 5 RL steps through ``launch.local``.

The conversion at TP2/PP2/EP2 with transformers-equal logits and a bit-exact live export runs
in tests/test_convert_roundtrip.py (the ``glm4_moe`` variant)."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from areal_mega.models.tiny import make_tiny_model
from tests._convert_jobs import compare, load_all
from tests._moe_family_worker import GLM4_MOE

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TOL = 1e-5


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("glm") / "hf", arch="glm4_moe",
                           num_layers=4, num_experts=8, moe_intermediate_size=32,
                           tie_word_embeddings=False)


def _run(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


# ---------------------------------------------------------------------------- config mapping
def test_glm4_moe_config_maps_onto_megatron_router_options():
    from areal_mega.compat import megatron_cpu
    megatron_cpu.apply()
    from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf
    arch = parse_hf_config(GLM4_MOE)
    assert arch.moe_layer_pattern == (0, 1, 1, 1)          # first_k_dense_replace=1
    assert (arch.rotary_percent, arch.qkv_bias, arch.qk_norm) == (0.5, True, True)
    assert arch.moe_shared_ffn_hidden_size == 32            # 1 shared expert x 32
    cfg = transformer_config_from_hf(arch, ep=2)
    assert cfg.moe_router_score_function == "sigmoid"
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_bias_update_rate == 0.0
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    assert cfg.moe_router_topk_scaling_factor == 2.5
    assert cfg.moe_shared_expert_intermediate_size == 32
    assert list(cfg.moe_layer_freq) == [0, 1, 1, 1]
    assert cfg.moe_router_load_balancing_type == "none"     # GLM has no aux-loss coefficient
    # all groups selected = no group limit; no partial_rotary_factor = transformers' 0.5
    plain = dict(GLM4_MOE, topk_group=2, rope_parameters={"rope_theta": 1e4})
    arch = parse_hf_config(plain)
    assert (arch.moe_num_groups, arch.moe_group_topk, arch.rotary_percent) == (None, None, 0.5)


@pytest.mark.parametrize("change, words", [
    (dict(norm_topk_prob=False), "renormalises"),
    (dict(num_experts_per_tok=4), "top-2"),              # 4 // topk_group 1 != 2
    (dict(n_group=3), "not divisible"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.3}), "even"),
])
def test_glm4_moe_options_megatron_cannot_reproduce_are_refused(change, words):
    from areal_mega.models.builder import parse_hf_config
    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(GLM4_MOE, **change))


def test_glm4_moe_mtp_tensors_are_recognised_and_skipped():
    from areal_mega.checkpoint.hf_mapping_moe import is_mtp_tensor
    from areal_mega.models.builder import parse_hf_config
    arch = parse_hf_config(dict(GLM4_MOE, num_nextn_predict_layers=1))
    assert is_mtp_tensor(arch, "model.layers.4.eh_proj.weight")
    assert not is_mtp_tensor(arch, "model.layers.3.mlp.gate.weight")
    assert not is_mtp_tensor(parse_hf_config(GLM4_MOE), "model.layers.4.eh_proj.weight")


# ---------------------------------------------------------------------------- conversion
def test_glm4_moe_cli_roundtrip_is_bit_exact(glm, tmp_path):
    _run([ROOT / "tools" / "convert_hf_to_mcore.py", "--hf-dir", glm, "--out",
          tmp_path / "mcore", "--tp", 2, "--pp", 2, "--ep", 2, "--no-progress"])
    _run([ROOT / "tools" / "convert_mcore_to_hf.py", "--mcore-dir", tmp_path / "mcore",
          "--out", tmp_path / "hf2", "--no-progress"])
    src, dst = load_all(glm), load_all(tmp_path / "hf2")
    assert any(k.endswith("e_score_correction_bias") for k in src)
    assert any(".shared_experts." in k for k in src)
    assert compare(src, dst) == []


# ---------------------------------------------------------------------------- layouts
def test_glm4_moe_layouts_match_single_rank(tmp_path):
    from areal_mega.common.net import free_port
    from tests.multirank import rank_results, run_ranks
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = run_ranks([[sys.executable, TESTS / "_moe_family_worker.py", "glm4_moe", r, 2, port,
                        tmp_path] for r in range(2)], timeout=300, env=env)
    res = rank_results([tmp_path / f"glm4_moe.{r}.json" for r in range(2)], ranks)
    for r in res:
        assert r["expert_bias_max"] > 0.01                  # the biases are really non-zero
        for layout in ("ep2", "tp2sp", "pp2"):
            for what in ("logprobs", "grads", "loss", "n_tokens"):
                assert r[f"{layout}.{what}"] < TOL, (layout, what, r)


# ---------------------------------------------------------------------------- rollout server
def _sample(srv, prompts, n_new):
    from areal_mega.inference.decoding import GenRequest
    from areal_mega.inference.sampling import SamplingParams
    done = [threading.Event() for _ in prompts]
    reqs = [GenRequest(rid=str(i), input_ids=list(p), on_done=lambda r, e=e: e.set(),
                       params=SamplingParams(max_new_tokens=n_new, temperature=1.0,
                                             ignore_eos=True, sampling_seed=i))
            for i, (p, e) in enumerate(zip(prompts, done))]
    for r in reqs:
        srv.engine.submit(r)
    assert all(e.wait(120) for e in done)
    return reqs


def test_glm4_moe_served_logprobs_equal_the_trainers(glm, tmp_path):
    """Sampled together (batched decode, rows of different lengths), each output token's
    logprob from the server equals the trainer's forward of the converted checkpoint."""
    from areal_mega.inference.server_state import LocalRolloutServer
    srv = LocalRolloutServer(str(glm), max_running=4)
    try:
        prompts = [[5, 9, 12, 40, 7], list(range(10, 19)), [33] * 3 + list(range(50, 60))]
        reqs = _sample(srv, prompts, 8)
        ids = torch.tensor([prompts[0]])
        with torch.no_grad():            # the expert bias decides routes in the served model
            with_bias = srv.model(ids).logits
            biases = [b for n, b in srv.model.named_buffers() if "e_score_correction" in n]
            saved = [b.clone() for b in biases]
            for b in biases:
                b.zero_()
            assert (srv.model(ids).logits - with_bias).abs().max() > 1e-4
            for b, s in zip(biases, saved):
                b.copy_(s)
    finally:
        srv.engine.shutdown()
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"seqs": [p + r.output_ids for p, r in zip(prompts, reqs)],
                               "starts": [len(p) for p in prompts]}))
    _run([TESTS / "_teacher_forward_worker.py", glm, tmp_path, job, tmp_path / "out.json"])
    trainer = json.loads((tmp_path / "out.json").read_text())["logprobs"]
    for r, want in zip(reqs, trainer):
        assert len(r.logprobs) == len(want) == 8
        assert max(abs(a - b) for a, b in zip(r.logprobs, want)) < TOL, (r.logprobs, want)


def test_glm4_moe_routing_replay_is_refused(glm):
    from transformers import AutoModelForCausalLM

    from areal_mega.engine.routing_replay import check_replay_target
    from areal_mega.inference.route_capture import RouteCapture
    from areal_mega.models.builder import parse_hf_config
    with pytest.raises(ValueError, match="sigmoid"):
        check_replay_target(True, "actor", parse_hf_config(GLM4_MOE))
    with pytest.raises(ValueError, match="expert bias"):
        RouteCapture(AutoModelForCausalLM.from_pretrained(glm))


# ---------------------------------------------------------------------------- RL
@pytest.mark.timeout(400)
def test_glm4_moe_five_rl_steps(tmp_path):
    """5 GRPO steps through launch.local (CPU server + trainer): every step trains (finite
    loss, non-zero gradient, dense reward), the first step's samples come from the trainer's own weights
    (mismatch of logprobs ~ 0), and the server samples with each step's trained weights with
    logprobs still equal to the trainer's."""
    from areal_mega.data.synthetic import write_task_files
    from test_e2e_async_rl import _finish, _launch, _metrics
    model = make_tiny_model(tmp_path / "model", arch="glm4_moe", charset="digits",
                            hidden_size=64, num_layers=2, num_experts=8,
                            moe_intermediate_size=32, tie_word_embeddings=False)
    write_task_files(tmp_path / "data", task="reverse", n_train=128, n_test=8)
    run = tmp_path / "run"
    proc = _launch(run, model, tmp_path / "data", "total_steps=5", "logging.plot=false",
                   "cluster.max_restarts=0", "checkpoint.save_every=0", "recover=off",
                   # a dense reward (character match), so that groups are not uniform
                   "rollout.reward_fn=areal_mega.rewards:char_match_reward")
    rc, out = _finish(proc, timeout=360)
    assert rc == 0, out[-4000:]
    rows = [r for r in _metrics(run) if r["step"]]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["grad_norm"] > 0 and r["loss"] == r["loss"], r
        # tokens sampled with the weights the trainer evaluates: the server's logprobs are
        # the trainer's, also after weight updates
        if r["mismatch_tokens"]:
            assert r["mismatch"] < TOL, r
    assert rows[0]["mismatch_tokens"] > 0
    assert rows[-1]["versions/max"] >= 3       # samples from weights pushed after 3+ steps

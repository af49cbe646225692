"""GLM-4 MoE (``glm4_moe``) and DeepSeek-V3 (``deepseek_v3``, multi-latent attention) end to end
on the CPU, from tiny HF models made here: their configs mapped onto megatron-core's options
(and the options megatron cannot reproduce refused), ``tools/convert_hf_to_mcore.py`` and back
bit-exactly, EP2 / TP2+SP / PP2 equal to a single rank (logprobs and grads), the CPU
rollout server's sampled logprobs equal to the trainer's forward, routing replay refused, and
5 RL steps through ``launch.local``.

The conversion at TP2/PP2/EP2 (both families) with transformers-equal logits and a bit-exact
live export runs in tests/test_convert_roundtrip.py (variants ``glm4_moe``, ``deepseek_v3``)."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from areal_mega.models.tiny import make_tiny_model
from tests.helpers.convert_worker import compare, load_all
from tests.helpers.moe_family_worker import DEEPSEEK_V3, GLM4_MOE
from tests.helpers.tool_batch import run_tools

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
FAMILIES = ("glm4_moe", "deepseek_v3")


def _tiny(path, family, **kw):
    return make_tiny_model(
        path,
        arch=family,
        num_experts=8,
        moe_intermediate_size=32,
        tie_word_embeddings=False,
        **{"num_layers": 4, **kw},
    )


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    return request.param, _tiny(tmp_path_factory.mktemp(request.param) / "hf", request.param)


def _run(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


# ---------------------------------------------------------------------------- config mapping
def test_glm4_moe_config_maps_onto_megatron_router_options():
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply()
    from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf

    arch = parse_hf_config(GLM4_MOE)
    assert arch.moe_layer_pattern == (0, 1, 1, 1)  # first_k_dense_replace=1
    assert (arch.rotary_percent, arch.qkv_bias, arch.qk_norm) == (0.5, True, True)
    assert arch.moe_shared_ffn_hidden_size == 32  # 1 shared expert x 32
    cfg = transformer_config_from_hf(arch, ep=2)
    assert cfg.moe_router_score_function == "sigmoid"
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_bias_update_rate == 0.0
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    assert cfg.moe_router_topk_scaling_factor == 2.5
    assert cfg.moe_shared_expert_intermediate_size == 32
    assert list(cfg.moe_layer_freq) == [0, 1, 1, 1]
    assert cfg.moe_router_load_balancing_type == "none"  # GLM has no aux-loss coefficient
    # all groups selected = no group limit; no partial_rotary_factor = transformers' 0.5
    plain = dict(GLM4_MOE, topk_group=2, rope_parameters={"rope_theta": 1e4})
    arch = parse_hf_config(plain)
    assert (arch.moe_num_groups, arch.moe_group_topk, arch.rotary_percent) == (None, None, 0.5)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(norm_topk_prob=False), "renormalises"),
        (dict(num_experts_per_tok=4), "top-2"),  # 4 // topk_group 1 != 2
        (dict(n_group=3), "not divisible"),
        (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.3}), "even"),
    ],
)
def test_glm4_moe_options_megatron_cannot_reproduce_are_refused(change, words):
    from areal_mega.models.builder import parse_hf_config

    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(GLM4_MOE, **change))


def test_deepseek_v3_config_maps_onto_megatron_mla_options():
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply()
    from megatron.core.transformer import MLATransformerConfig

    from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf

    arch = parse_hf_config(DEEPSEEK_V3)
    assert arch.is_mla and arch.head_dim == 24 and arch.num_kv_heads == arch.num_heads
    cfg = transformer_config_from_hf(arch, tp=2)
    assert isinstance(cfg, MLATransformerConfig) and cfg.multi_latent_attention
    assert (
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_head_dim,
        cfg.qk_pos_emb_head_dim,
        cfg.v_head_dim,
        cfg.kv_channels,
    ) == (32, 32, 16, 8, 16, 16)
    assert cfg.qk_layernorm and cfg.rope_type == "rope"  # the latent norms; no YaRN
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(rope_interleave=False), "interleaved"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}), "yarn"),
    ],
)
def test_deepseek_v3_options_megatron_cannot_reproduce_are_refused(change, words):
    from areal_mega.models.builder import parse_hf_config

    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(DEEPSEEK_V3, **change))


def test_glm4_moe_mtp_tensors_are_recognised_and_skipped():
    from areal_mega.checkpoint.hf_mapping_moe import is_mtp_tensor
    from areal_mega.models.builder import parse_hf_config

    arch = parse_hf_config(dict(GLM4_MOE, num_nextn_predict_layers=1))
    assert is_mtp_tensor(arch, "model.layers.4.eh_proj.weight")
    assert not is_mtp_tensor(arch, "model.layers.3.mlp.gate.weight")
    assert not is_mtp_tensor(parse_hf_config(GLM4_MOE), "model.layers.4.eh_proj.weight")


def test_exaone_moe_mtp_tensors_are_recognised_and_skipped():
    """K-EXAONE keeps its multi-token-prediction layer under ``mtp.`` (transformers skips it on
    load): the converters skip it, and a layer past the last is not taken for one."""
    from areal_mega.checkpoint.hf_mapping_moe import is_mtp_tensor
    from areal_mega.models.builder import normalize_hf_config, parse_hf_config
    from areal_mega.models.tiny import TinyModelSpec
    from areal_mega.models.tiny_configs import tiny_hf_config

    spec = TinyModelSpec(arch="exaone_moe", sliding_window=8, tie_word_embeddings=False)
    arch = parse_hf_config(normalize_hf_config(tiny_hf_config(spec, 22, 0, 1).to_dict()))
    assert is_mtp_tensor(arch, "mtp.layers.0.self_attn.q_proj.weight")
    assert is_mtp_tensor(arch, "mtp.fc.weight")
    assert not is_mtp_tensor(arch, "model.layers.1.mlp.gate.weight")
    assert not is_mtp_tensor(arch, "model.layers.2.mlp.gate.weight")


# ---------------------------------------------------------------------------- conversion
def test_cli_roundtrip_is_bit_exact(family_model, tmp_path):
    _, model = family_model
    mcore, hf2 = tmp_path / "mcore", tmp_path / "hf2"
    run_tools(  # one interpreter for both directions
        [
            ["tools/convert_hf_to_mcore.py", "--hf-dir", model, "--out", mcore]
            + ["--tp", 2, "--pp", 2, "--ep", 2, "--no-progress"],
            ["tools/convert_mcore_to_hf.py", "--mcore-dir", mcore, "--out", hf2, "--no-progress"],
        ],
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )
    src, dst = load_all(model), load_all(tmp_path / "hf2")
    assert any(k.endswith("e_score_correction_bias") for k in src)
    assert any(".shared_experts." in k for k in src)
    assert compare(src, dst) == []


# ---------------------------------------------------------------------------- layouts
@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Both families' layout checks from one 2-rank launch: ``{family: [rank results]}``."""
    from areal_mega.common.net import free_port
    from tests.helpers.multirank import rank_results, run_ranks
    from tests.helpers.workers import worker_cmd

    out = tmp_path_factory.mktemp("layouts")
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = run_ranks(
        [worker_cmd("moe_family_worker", "both", r, 2, port, out) for r in range(2)],
        timeout=480,
        env=env,
    )
    res = rank_results([out / f"both.{r}.json" for r in range(2)], ranks)
    return {family: [r[family] for r in res] for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_match_single_rank(family, layouts):
    for r in layouts[family]:
        assert r["expert_bias_max"] > 0.01  # the biases are really non-zero
        for layout in ("ep2", "tp2sp", "pp2"):
            for what in ("logprobs", "grads", "loss", "n_tokens", "grad_norm"):
                assert r[f"{layout}.{what}"] < TOL, (layout, what, r)
        if family == "deepseek_v3":  # megatron's local MLA still needs the CPU patch
            assert r["tp2sp_unpatched.grads"] > 10 * TOL, r


# ---------------------------------------------------------------------------- rollout server
def _sample(srv, prompts, n_new):
    from areal_mega.inference.decoding import GenRequest
    from areal_mega.inference.sampling import SamplingParams

    done = [threading.Event() for _ in prompts]
    reqs = [
        GenRequest(
            rid=str(i),
            input_ids=list(p),
            on_done=lambda r, e=e: e.set(),
            params=SamplingParams(
                max_new_tokens=n_new, temperature=1.0, ignore_eos=True, sampling_seed=i
            ),
        )
        for i, (p, e) in enumerate(zip(prompts, done))
    ]
    for r in reqs:
        srv.engine.submit(r)
    assert all(e.wait(120) for e in done)
    return reqs


def test_served_logprobs_equal_the_trainers(family_model, tmp_path):
    """Sampled together (batched decode, rows of different lengths), each output token's
    logprob from the server equals the trainer's forward of the converted checkpoint."""
    from areal_mega.inference.server_state import LocalRolloutServer

    _, model = family_model
    srv = LocalRolloutServer(str(model), max_running=4)
    try:
        prompts = [[5, 9, 12, 40, 7], list(range(10, 19)), [33] * 3 + list(range(50, 60))]
        reqs = _sample(srv, prompts, 8)
        ids = torch.tensor([prompts[0]])
        with torch.no_grad():  # the expert bias decides routes in the served model
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
    job.write_text(
        json.dumps(
            {
                "seqs": [p + r.output_ids for p, r in zip(prompts, reqs)],
                "starts": [len(p) for p in prompts],
            }
        )
    )
    _run(
        ["-m", "tests.helpers.teacher_forward_worker", model, tmp_path, job, tmp_path / "out.json"]
    )
    trainer = json.loads((tmp_path / "out.json").read_text())["logprobs"]
    for r, want in zip(reqs, trainer):
        assert len(r.logprobs) == len(want) == 8
        assert max(abs(a - b) for a, b in zip(r.logprobs, want)) < TOL, (r.logprobs, want)


def test_server_loads_a_checkpoint_by_its_hf_names(family_model, tmp_path):
    """A weight load (the per-expert, shared-expert and expert-bias names of an HF checkpoint)
    makes the served model compute what transformers computes for that checkpoint."""
    from transformers import AutoModelForCausalLM

    from areal_mega.inference.server_state import LocalRolloutServer

    family, model = family_model
    other = _tiny(tmp_path / "b", family, seed=5)
    srv = LocalRolloutServer(str(model), max_running=2)
    try:
        ids = torch.tensor([[3, 5, 7, 9, 11, 40, 41]])
        want = AutoModelForCausalLM.from_pretrained(other).eval()(ids).logits.detach()
        with torch.no_grad():
            assert (srv.model(ids).logits - want).abs().max() > 1e-3
            srv.load_from_disk(str(other), "1")
            assert (srv.model(ids).logits - want).abs().max() < 1e-6
    finally:
        srv.engine.shutdown()


def test_routing_replay_is_refused(family_model):
    from transformers import AutoModelForCausalLM

    from areal_mega.engine.routing_replay import check_replay_target
    from areal_mega.inference.route_capture import RouteCapture
    from areal_mega.models.builder import parse_hf_config

    family, model = family_model
    hf = {"glm4_moe": GLM4_MOE, "deepseek_v3": DEEPSEEK_V3}[family]
    with pytest.raises(ValueError, match="sigmoid"):
        check_replay_target(True, "actor", parse_hf_config(hf))
    with pytest.raises(ValueError, match="expert bias"):
        RouteCapture(AutoModelForCausalLM.from_pretrained(model))
    from areal_mega.config import ConfigError, config_from_dict
    from areal_mega.rollout.routes import replay_layout

    cfg = config_from_dict({"model": {"path": str(model)}, "algorithm": {"routing_replay": "r3"}})
    with pytest.raises(ConfigError, match=f"algorithm.routing_replay='r3'.*{family}.*sigmoid"):
        replay_layout(cfg)


# ---------------------------------------------------------------------------- RL
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_five_rl_steps(family, tmp_path):
    """5 GRPO steps through launch.local (CPU server + trainer, dense reward): every step has a
    finite loss and most a non-zero gradient, the first step's samples come from the trainer's own
    weights
    (mismatch of logprobs ~ 0), and the server samples with each step's trained weights with
    logprobs still equal to the trainer's."""
    from areal_mega.data.synthetic import write_task_files
    from tests.helpers.local_runs import _finish, _launch, _metrics

    model = _tiny(tmp_path / "model", family, charset="digits", num_layers=2)
    write_task_files(tmp_path / "data", task="reverse", n_train=128, n_test=8)
    run = tmp_path / "run"
    proc = _launch(
        run,
        model,
        tmp_path / "data",
        "total_steps=5",
        "logging.plot=false",
        "cluster.max_restarts=0",
        "checkpoint.save_every=0",
        "recover=off",
        # a dense reward (character match), so that groups are not uniform
        "rollout.reward_fn=areal_mega.rewards:char_match_reward",
    )
    rc, out = _finish(proc, timeout=360)
    assert rc == 0, out[-4000:]
    rows = [r for r in _metrics(run) if r["step"]]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # a group whose samples all get the same reward has no advantage (a tiny random model
    # sometimes draws such a batch): most steps, not each, must move the weights
    assert sum(r["grad_norm"] > 0 for r in rows) >= 3, rows
    for r in rows:
        assert r["loss"] == r["loss"], r
        # tokens sampled with the weights the trainer evaluates: the server's logprobs are
        # the trainer's, also after weight updates
        if r["mismatch_tokens"]:
            assert r["mismatch"] < TOL, r
    assert rows[0]["mismatch_tokens"] > 0
    assert rows[-1]["versions/max"] >= 3  # samples from weights pushed after 3+ steps

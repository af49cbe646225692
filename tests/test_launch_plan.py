"""Recipes validate with --dry-run; memory arithmetic on hand-computed cases; node layouts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.common.net import free_ports
from areal_mega.config import ConfigError, ModelHParams, load_config
from areal_mega.config.sections import DataImagesConfig
from areal_mega.data.images import DEFAULT_MAX_IMAGES
from areal_mega.launch import local, server_commands
from areal_mega.launch.memory import (
    KNOWN_MODELS,
    count_params,
    estimate_memory,
    hparams_from_hf_config,
    known_model_key,
)
from areal_mega.launch.plan import assign_ports, plan_layout
from areal_mega.parallel.allocation import ParallelDims, parse_allocation

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_recipe_set_is_complete():
    names = {p.name for p in RECIPES}
    assert {
        "tiny-cpu.yaml",
        "qwen2.5-1.5b-math.yaml",
        "qwen2.5-7b-math.yaml",
        "qwen2.5-32b-math.yaml",
        "qwen3-30b-a3b-math.yaml",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_dry_run(recipe):
    r = subprocess.run(
        [sys.executable, "-m", "areal_mega.launch.local", "--config", str(recipe), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for words in (
        "config OK",
        "allocation:",
        "rollout:",
        "trainer: world",
        "node 0:",
        "weights",
        "grads",
        "optimizer",
        "activations",
        "total",
    ):
        assert words in out, (words, out)
    cfg = load_config(recipe)
    assert "DOES NOT FIT" not in out
    if cfg.cluster.device == "cuda":  # GPU recipes use exactly their nodes
        lay = local.make_layout(cfg)
        used = {s.node for s in lay.servers} | set(lay.trainer_nodes)
        assert len(used) == cfg.cluster.n_nodes, out
        assert f"of {cfg.cluster.gpu_memory_gb:g} GiB" in out
        assert "model_hparams" in recipe.read_text()  # arithmetic is adaptable in the file


def test_recipe_nodes_match_issue():
    want = {"qwen2.5-1.5b-math": 1, "qwen2.5-7b-math": 2, "qwen2.5-32b-math": 8}
    for name, nodes in want.items():
        assert load_config(ROOT / "recipes" / f"{name}.yaml").cluster.n_nodes == nodes
    moe = load_config(ROOT / "recipes" / "qwen3-30b-a3b-math.yaml")
    assert parse_allocation(moe.allocation).trainer.ep > 1 and moe.model_hparams.num_experts


def test_launcher_imports_no_torch():
    """launch.local (the parent of every process of a run, and ``--dry-run``) plans without
    torch: importing it would cost each launch ~2 s before the first process starts."""
    r = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "areal_mega.launch.local",
            "--config",
            str(ROOT / "recipes" / "tiny-cpu.yaml"),
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "config OK" in r.stdout, r.stdout[-2000:]
    imported = [
        ln.rsplit("|", 1)[1].strip()
        for ln in r.stderr.splitlines()
        if ln.startswith("import time:")
    ]
    assert "areal_mega.launch.local" in imported or "areal_mega.launch" in imported
    assert "torch" not in imported


def test_dry_run_bad_override_names_key(capsys):
    rc = local.main(
        ["--config", str(ROOT / "recipes/tiny-cpu.yaml"), "--dry-run", "rollout.n_samples=0"]
    )
    assert rc == 2 and "rollout.n_samples" in capsys.readouterr().err
    rc = local.main(
        ["--config", str(ROOT / "recipes/qwen2.5-7b-math.yaml"), "--dry-run", "cluster.n_nodes=1"]
    )
    assert rc == 2 and "cluster.n_nodes=1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- memory


SMALL = ModelHParams(
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    vocab_size=100,
)


def test_param_counts_match_published_totals():
    # published: 1.54B, 7.61B, 32.8B (32.5B non-embedding+...), 30.5B total / 3.3B active
    expect = {
        "qwen2.5-1.5b": 1.54e9,
        "qwen2.5-7b": 7.62e9,
        "qwen2.5-32b": 32.76e9,
        "qwen3-30b-a3b": 30.53e9,
    }
    for key, total in expect.items():
        assert count_params(KNOWN_MODELS[key]).total == pytest.approx(total, rel=0.005)
    assert count_params(KNOWN_MODELS["qwen3-30b-a3b"]).active == pytest.approx(3.35e9, rel=0.01)
    assert count_params(SMALL).total == 160832


def test_memory_hand_computed_dense():
    # per layer: attention 3*64*64 + 64*32 ... = 12288, mlp 3*64*128 = 24576, norms 128
    # pp=2 -> 2 layers + embedding 6400 on stage 0: (2*36864 + 6400)/tp2 + 2*128 = 40320 params
    e = estimate_memory(
        SMALL,
        ParallelDims(dp=2, tp=2, pp=2),
        dtype="bf16",
        use_distributed_optimizer=True,
        tokens_per_mb=1000,
        overhead_bytes=0,
    )
    assert e.params_per_gpu == 40320 and e.layers_per_stage == 2
    assert e.weights == 2 * 40320 and e.grads == 4 * 40320
    assert e.optimizer == 12 * 40320 / 2
    # per token per layer (SP): 2 B * (4*64/2 + (2*64 + 2*32)/2 + 4*128/2) = 960 B;
    # 1000 tokens * 2 layers * 2 micro-batches in flight
    assert e.activations == 960 * 1000 * 2 * 2
    assert e.logits == 1000 * 100 / 2 * 4
    assert e.total == 80640 + 161280 + 241920 + 3_840_000 + 200_000
    full = estimate_memory(
        SMALL,
        ParallelDims(dp=2, tp=2, pp=2),
        recompute="full",
        tokens_per_mb=1000,
        overhead_bytes=0,
    )
    assert full.activations == 4 * (1000 * 2 * 64 / 2) + 960_000
    plain = estimate_memory(
        SMALL,
        ParallelDims(dp=2, tp=2, pp=2),
        tokens_per_mb=1000,
        use_distributed_optimizer=False,
        overhead_bytes=0,
    )
    assert plain.optimizer == 12 * 40320
    fp32 = estimate_memory(
        SMALL, ParallelDims(dp=2, tp=2, pp=2), dtype="fp32", tokens_per_mb=1000, overhead_bytes=0
    )
    assert fp32.weights == 4 * 40320 and fp32.optimizer == 8 * 40320 / 2
    cp2 = estimate_memory(
        SMALL, ParallelDims(dp=1, tp=2, pp=2, cp=2), tokens_per_mb=1000, overhead_bytes=0
    )
    assert cp2.activations == e.activations / 2 and cp2.optimizer == e.optimizer


def test_memory_hand_computed_moe():
    hp = ModelHParams(
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        vocab_size=100,
        tie_word_embeddings=True,
        num_experts=4,
        moe_ffn_hidden_size=32,
        moe_topk=2,
    )
    c = count_params(hp)
    assert c.experts == 4 * 3 * 64 * 32 and c.total == 89152 and c.active == 64576
    e = estimate_memory(hp, ParallelDims(dp=4, ep=2), tokens_per_mb=10, overhead_bytes=0)
    # dense: 2*16384 + 6400 + 2*(128 + router 256) = 39936; experts 2*24576/ep2 = 24576
    assert e.params_per_gpu == 39936 + 24576
    assert e.optimizer == 12 * (39936 / 4 + 24576 / 2)
    # TP2 with the experts at expert TP 2 (the default) or 1 (their own, MoE parallel folding):
    # whole experts on each rank, their optimizer state sharded over expert DP 2 instead of 1
    split, whole = (
        estimate_memory(hp, ParallelDims(dp=2, tp=2, ep=2, etp=etp), tokens_per_mb=10)
        for etp in (None, 1)
    )
    assert whole.params_per_gpu - split.params_per_gpu == 24576 - 12288
    assert whole.optimizer - split.optimizer == 12 * (24576 / 2 - 12288 / 1)


def test_hparams_from_hf_config_and_names(tmp_path):
    from areal_mega.models.tiny import make_tiny_model

    d = make_tiny_model(
        tmp_path / "m",
        arch="qwen3_moe",
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        charset="digits",
    )
    hp = hparams_from_hf_config(d / "config.json")
    assert hp.num_experts == 4 and hp.moe_topk == 2 and hp.qk_norm and hp.tie_word_embeddings
    import torch  # noqa: F401  (transformers already imported it)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        n = sum(f.get_tensor(k).numel() for k in f.keys())
    assert count_params(hp).total == n  # the formula counts the real checkpoint exactly
    # Nemotron: an MLP without a gate, LayerNorms with biases, untied
    d = make_tiny_model(tmp_path / "n", arch="nemotron", tie_word_embeddings=False)
    hp = hparams_from_hf_config(d / "config.json")
    assert not hp.gated_mlp and hp.norm_bias and not hp.tie_word_embeddings
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert count_params(hp).total == sum(f.get_tensor(k).numel() for k in f.keys())
    # Nemotron-H: Mamba layers are not modelled, refused naming the way out
    d = make_tiny_model(tmp_path / "nh", arch="nemotron_h")
    with pytest.raises(ValueError, match="hybrid.*model_hparams"):
        hparams_from_hf_config(d / "config.json")
    # Ernie 4.5 MoE's names (moe_num_experts, moe_k, shared experts of moe_intermediate_size);
    # every layer MoE here (the formula counts every layer of an MoE model as MoE), and the
    # expert bias, [1, experts] per layer, is no weight of the formula's
    d = make_tiny_model(tmp_path / "e", arch="ernie4_5_moe", hidden_size=32, num_layers=2)
    cfg_path = d / "config.json"
    cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), moe_layer_start_index=0)))
    hp = hparams_from_hf_config(cfg_path)
    assert (hp.num_experts, hp.moe_topk, hp.moe_ffn_hidden_size) == (4, 2, 64)
    assert hp.shared_expert_ffn_hidden_size == 64
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    n = sum(p.numel() for name, p in model.named_parameters() if "moe_statics" not in name)
    assert count_params(hp).total == n
    assert known_model_key("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert known_model_key("/m/Qwen3-30B-A3B-Base") == "qwen3-30b-a3b"
    assert known_model_key("/m/llama") is None
    cfg = load_config(None, [f"model.path={d}"])
    assert local.resolve_hparams(cfg)[1].endswith("config.json")
    with pytest.raises(ConfigError, match="model_hparams"):
        local.resolve_hparams(load_config(None, ["model.path=/nope/x"]))


# ----------------------------------------------------------------------------- layout


def test_layout_single_node_shares_gpus():
    lay = plan_layout(
        parse_allocation("sglang:d2t2+megatron:d2t2"),
        n_nodes=1,
        gpus_per_node=8,
        ports=[9000, 9001],
    )
    assert [s.gpus for s in lay.servers] == [(0, 1), (2, 3)]
    assert [s.port for s in lay.servers] == [9000, 9001]
    assert lay.trainer_nodes == [0] and lay.trainer_gpus == (4, 5, 6, 7)
    assert lay.ranks_per_node() == {0: {"rollout": [0, 1], "trainer": [0, 1, 2, 3]}}


def test_layout_multi_node_and_errors():
    lay = plan_layout(parse_allocation("sglang:d3t2+megatron:d4t4"), n_nodes=3, gpus_per_node=8)
    assert [s.node for s in lay.servers] == [0, 0, 0]
    assert lay.trainer_nodes == [1, 2] and lay.trainer_nproc_per_node == 8
    assert any("idle" in n for n in lay.notes)
    with pytest.raises(ConfigError, match="cluster.n_nodes=2"):
        plan_layout(parse_allocation("sglang:d3t2+megatron:d4t4"), n_nodes=2, gpus_per_node=8)
    with pytest.raises(ConfigError, match="cannot span nodes"):
        plan_layout(parse_allocation("sglang:d1t16+megatron:d8"), n_nodes=4, gpus_per_node=8)
    with pytest.raises(ConfigError, match="multiple of"):
        plan_layout(parse_allocation("sglang:d8+megatron:d12"), n_nodes=4, gpus_per_node=8)
    with pytest.raises(ConfigError, match="tensor parallel"):
        plan_layout(parse_allocation("sglang:d1+megatron:t16"), n_nodes=4, gpus_per_node=8)
    ext = plan_layout(
        parse_allocation("megatron:d8"), n_nodes=1, gpus_per_node=8, external_servers=["h:1"]
    )
    assert ext.servers == [] and ext.trainer_gpus == tuple(range(8))
    with pytest.raises(ConfigError, match="server_addrs"):
        plan_layout(parse_allocation("megatron:d8"), n_nodes=1, gpus_per_node=8)
    cpu = plan_layout(parse_allocation("local:d2+megatron:d2"), device="cpu")
    assert len(cpu.servers) == 2 and cpu.trainer_nproc_per_node == 2 and cpu.trainer_gpus == ()


def test_ports():
    assert assign_ports(3, 8000, taken={8001}) == [8000, 8002, 8003]
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(1024 <= p <= 65535 for p in ports)


def test_server_commands(tmp_path):
    cfg = load_config(
        ROOT / "recipes/qwen2.5-32b-math.yaml", ["rollout.api_key=k", f"logging.run_dir={tmp_path}"]
    )
    lay = local.planned_layout(cfg)
    argv = local.server_command(cfg, lay.servers[3], "0.0.0.0")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(argv)
    assert "--tp-size 4" in joined and "--port 30001" in joined and "--api-key" not in joined
    assert f"--config {tmp_path}/sglang-api-key.yaml" in joined  # the key stays off argv
    assert "--model-path /models/Qwen2.5-32B-Instruct" in joined and "--base-gpu-id 0" in joined
    assert lay.servers[3].gpus == (4, 5, 6, 7) and lay.servers[3].node == 1
    cpu = load_config(ROOT / "recipes/tiny-cpu.yaml")
    slot = local.make_layout(cpu, ports=[1234]).servers[0]
    assert local.server_command(cpu, slot)[1:] == [
        "-m",
        server_commands.ROLLOUT_SERVER_MODULE,
        "--model-path",
        "runs/tiny-cpu/model",
        "--host",
        "127.0.0.1",
        "--port",
        "1234",
        "--num-threads",
        "1",
    ]
    cpu3 = load_config(ROOT / "recipes/tiny-cpu.yaml", ["cluster.cpu_threads_per_server=3"])
    assert local.server_command(cpu3, slot)[-2:] == ["--num-threads", "3"]
    # a bf16 run's server loads and generates in bf16, as the trainer computes
    cpu_bf16 = load_config(ROOT / "recipes/tiny-cpu.yaml", ["model.dtype=bf16"])
    assert local.server_command(cpu_bf16, slot)[-2:] == ["--dtype", "bf16"]
    # a LoRA run's servers load adapters only from the run directory (where they are published)
    lora = load_config(
        ROOT / "recipes/tiny-cpu.yaml", ["lora.enabled=true", f"logging.run_dir={tmp_path}"]
    )
    argv = local.server_command(lora, slot)
    assert argv[argv.index("--lora-allowed-dirs") + 1] == str(tmp_path.resolve())
    # the dataset's image limit is the server's (the default is the server's own)
    many = load_config(ROOT / "recipes/tiny-cpu.yaml", ["data.images.max_images=24"])
    assert local.server_command(many, slot)[-2:] == ["--max-images", "24"]
    assert DataImagesConfig().max_images == DEFAULT_MAX_IMAGES


def test_cpu_threads_per_trainer_rank():
    from areal_mega.launch.local import cpu_threads_per_trainer_rank

    assert cpu_threads_per_trainer_rank(2, n_servers=1, nproc=1) == 1
    assert cpu_threads_per_trainer_rank(16, n_servers=2, nproc=2) == 7
    assert cpu_threads_per_trainer_rank(2, n_servers=4, nproc=2) == 1  # never zero
    assert cpu_threads_per_trainer_rank(16, n_servers=2, nproc=2, server_threads=4) == 4
    assert cpu_threads_per_trainer_rank(16, n_servers=2, nproc=2, configured=3) == 3


def test_cpu_thread_keys_reach_the_trainer_environment(tmp_path):
    for keys, want in (([], "1"), (["cluster.cpu_threads_per_trainer_rank=2"], "2")):
        cfg = load_config(ROOT / "recipes/tiny-cpu.yaml", [f"logging.run_dir={tmp_path}", *keys])
        specs, _ = local.build_specs(cfg, device="cpu")
        trainer = next(s for s in specs if s.name == "trainer")
        assert trainer.env["OMP_NUM_THREADS"] == (
            want if keys else str(max(1, (os.cpu_count() or 1) - 1))
        ), keys


def test_a_lone_trainer_rank_gets_the_address_torchrun_would_give_it(tmp_path):
    """Without torchrun, the one rank still gets ``MASTER_ADDR`` = this node's name, as
    torchrun's standalone rendezvous sets it (the weight-update group's address, which
    servers on other machines dial); with several ranks torchrun sets it."""
    import socket

    for alloc, want in (("local:d1+megatron:d1", socket.getfqdn()), ("local:d1+megatron:d2", None)):
        cfg = load_config(
            ROOT / "recipes/tiny-cpu.yaml",
            [f"logging.run_dir={tmp_path / alloc}", f"allocation={alloc}"],
        )
        specs, _ = local.build_specs(cfg, device="cpu")
        trainer = next(s for s in specs if s.name == "trainer")
        assert trainer.env.get("MASTER_ADDR") == want, alloc


def test_one_trainer_rank_runs_without_torchrun(tmp_path):
    """One rank: the trainer module itself (no torchrun agent, ~2.5 s of imports less per
    launch); several: torchrun --standalone; extra arguments follow the config either way."""
    cfg = tmp_path / "config.yaml"
    one = local.trainer_command(cfg, 1, ["a=1"])
    assert one == [sys.executable, "-m", local.TRAINER_MODULE, "--config", str(cfg), "a=1"]
    two = local.trainer_command(cfg, 2)
    assert two[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert two[two.index("--nproc-per-node") + 1] == "2"
    assert two[-4:] == ["-m", local.TRAINER_MODULE, "--config", str(cfg)]


def test_a_single_rank_without_master_port_needs_no_fixed_port():
    """A rank started alone (no torchrun, no MASTER_PORT) initialises its process group on a
    port the OS picks: two of them at once, while another process holds torch's default
    29500, both come up."""
    import socket

    code = (
        "import torch, torch.distributed as dist\n"
        "from areal_mega.parallel.mesh import init_distributed\n"
        "init_distributed(backend='gloo')\n"
        "t = torch.ones(1); dist.all_reduce(t); assert dist.get_world_size() == 1\n"
        "print('ok', t.item())\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")
    }
    env["PYTHONPATH"] = str(ROOT)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            holder.bind(("127.0.0.1", 29500))
            holder.listen()
        except OSError:
            pass  # someone else holds it already: the case under test
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        holder.close()
    assert [p.returncode for p in procs] == [0, 0] and all("ok 1.0" in o for o in outs), outs

"""HF -> megatron dist_checkpointing -> HF conversion: bit-exact for every family and option,
the converted checkpoint loads under TP1/TP2/PP2/EP2 with transformers-equal logits and a
bit-exact live export, and conversion memory stays bounded by the largest tensor."""

import json
import subprocess
import sys

import pytest

from tests.helpers.conversions import ROOT, launch_2ranks, results, run_jobs, session_dir
from tests.helpers.convert_worker import VARIANTS, compare, load_all


@pytest.fixture(scope="session")
def jobs(tmp_path_factory):
    return run_jobs(session_dir(tmp_path_factory))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_roundtrip_bit_exact(jobs, variant):
    r = results(jobs)[variant]
    assert r["n_tensors"] > 0
    assert r["mismatches"] == [], r["mismatches"]  # every tensor, every byte
    files = r["hf2_files"]
    assert "config.json" in files and "tokenizer.json" in files
    assert "model.safetensors.index.json" in files
    assert any(f.startswith("model-00001-of-") for f in files)
    assert r["transformers_params"] > 0  # transformers loaded the output
    meta = json.loads((jobs / variant / "mcore" / "iter_0000000" / "areal_meta.json").read_text())
    assert meta["complete"] and meta["padded_vocab_size"] % 128 == 0
    assert meta["vocab_size"] < meta["padded_vocab_size"]  # padding was done (and undone)
    assert (jobs / variant / "mcore" / "latest").read_text().strip() == "iter_0000000"
    assert (jobs / variant / "mcore" / "iter_0000000" / "hf" / "config.json").is_file()


def test_dense_layouts_logits_export_resume(jobs, tmp_path):
    """Qwen2 (QKV bias, untied) and Llama (tied, GQA) checkpoints converted at 'TP2 PP2' load
    at TP1/TP2/PP2: logits = transformers to 1e-5, live export = the HF files bit-exactly.
    A training checkpoint resumes bit-exactly (regular and distributed optimizer) and reshards
    TP1 -> TP2 (weights; and distributed-optimizer state: the next step matches); saved by the
    regular optimizer it resumes with the distributed one and back, in fp32 and bf16 (the next
    step matches)."""
    ranks = launch_2ranks("dense", tmp_path, jobs)
    for res in ranks:
        for tag, c in res["checks"].items():
            assert c["export"]["bad"] == [] and c["export"]["missing"] == [], (tag, c)
            if "logits_max_abs_diff" in c:
                assert c["logits_max_abs_diff"] <= 1e-5, (tag, c)
        rs = res["resume"]
        assert rs["loaded"]["iteration"] == 1 and rs["loaded"]["optimizer"]
        assert rs["loaded"]["extra"] == {"version": 1, "data_pos": 7}
        assert rs["loaded"]["rng"]
        assert rs["resume_bitexact"], rs["resume_max_abs_diff"]
        assert rs["lr_equal"]
        assert rs["after_prune"] == [
            "iter_0000002",
            "iter_0000003",
            "iter_0000008",
            "iter_0000009.tmp",
            "latest",
        ]
        assert rs["latest_after_junk"] == "iter_0000003"
        assert rs["checksums_cover_all_files"]  # both ranks' shards, hashed by their writer
        assert rs["fallback"] == {
            "path": "iter_0000002",
            "iteration": 2,
            "dirs": [
                "iter_0000002",
                "iter_0000003.corrupt",
                "iter_0000008",
                "iter_0000009.tmp",
                "latest",
            ],
        }
        assert rs["reshard"]["export_bitexact"], rs["reshard"]
        assert rs["reshard"]["logits_max_abs_diff"] <= 1e-5
        assert not rs["reshard"]["rng_restored"]  # layout changed: RNG left alone
        do = res["resume_distopt"]  # distributed optimizer: our model-space state format
        assert do["loaded"]["optimizer"] and do["resume_bitexact"], do
        assert do["lr_equal"]
        # optimizer state resharded DP2xTP1 -> TP2: the same global step gives the same weights
        assert do["opt_reshard_loaded_optimizer"]
        assert do["opt_reshard_tp2_max_abs_diff"] <= 1e-6, do
        # use_distributed_optimizer switched between save and resume (each kind loads the
        # other's state by key), fp32 and bf16: the same second step gives the same weights
        for dtype in ("", ",bf16"):
            for a, b in (("dp2,regular", "dp2"), ("dp2", "dp2,regular")):
                r = res[f"resume {a}{dtype} -> {b}{dtype}"]
                assert r["loaded_optimizer"] and r["names_equal"], r
                assert r["step_change"] > 1e-4, r
                assert r["max_abs_diff"] <= 1e-6, r
    # a checkpoint saved by TP2 ranks converts to HF equal to the TP2 live export, bit-exactly
    p = subprocess.run(
        [
            sys.executable,
            "tools/convert_mcore_to_hf.py",
            "--mcore-dir",
            str(tmp_path / "tp2_ckpt"),
            "--out",
            str(tmp_path / "tp2_hf"),
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    from safetensors.torch import load_file

    assert compare(load_file(tmp_path / "tp2_ref.safetensors"), load_all(tmp_path / "tp2_hf")) == []
    assert {
        "qwen2_untied_bias:dp2",
        "qwen2_untied_bias:tp2",
        "qwen2_untied_bias:pp2",
        "llama_tied_gqa:tp2",
        "llama_tied_gqa:pp2",
        "llama_4layers_vpp:pp2,vpp2",
    } <= set(ranks[0]["checks"])
    # tied + PP2: the first stage exports the embedding, the last skips its tied copy
    assert [r["checks"]["llama_tied_gqa:pp2"]["export"]["n"] for r in ranks] == [10, 10]
    # stage 0 holds the embedding and layers 0 and 2 (two virtual chunks)
    assert ranks[0]["checks"]["llama_4layers_vpp:pp2,vpp2"]["export"]["n"] == 19


def test_moe_layouts_logits_export(jobs, tmp_path):
    """Qwen3-MoE, GLM-4 MoE and DeepSeek-V3 (MLA) converted at 'TP2 PP2 EP2' load at EP2 (experts,
    shared experts and expert biases exported back bit-exactly), TP2 and PP2; logits =
    transformers at TP1 (Qwen3-MoE), TP2 and EP2; Qwen3-MoE also at TP2 with the experts at expert
    TP 1, and its training checkpoint (distributed optimizer) saved at expert TP 2 resumes at
    expert TP 1 (TP2 with SP), saved at EP2 resumes at EP1 (DP2), also with the regular
    optimizer (the experts' own optimizer of the chain merged), and back: the next step gives
    the same weights."""
    ranks = launch_2ranks("moe", tmp_path, jobs)
    qwen3 = ("dp2,ep2", "tp2", "pp2", "tp2,etp1")
    for res in ranks:
        checks = res["checks"]
        assert {f"qwen3_moe_untied:{t}" for t in qwen3} <= set(checks)
        for tag, c in checks.items():
            assert c["export"]["bad"] == [] and c["export"]["missing"] == [], (tag, c)
            if "logits_max_abs_diff" in c:
                assert c["logits_max_abs_diff"] <= 1e-5, (tag, c)
        assert all(
            "logits_max_abs_diff" in checks[t]
            for t in (
                "qwen3_moe_untied:dp2,ep2",
                "qwen3_moe_untied:tp2",
                "qwen3_moe_untied:dp2",
                "qwen3_moe_untied:tp2,etp1",
            )
        )
        for fam in ("glm4_moe", "deepseek_v3"):
            assert all("logits_max_abs_diff" in checks[f"{fam}:{t}"] for t in ("dp2,ep2", "tp2"))
            assert f"{fam}:pp2" in checks
        # a training checkpoint (distributed optimizer) resumed at the other expert TP or EP: the
        # same second step gives the same weights
        pairs = [("tp2", "tp2,etp1"), ("dp2,ep2", "dp2"), ("dp2,ep2", "dp2,regular")]
        for a, b in pairs + [(b, a) for a, b in pairs]:
            r = res[f"resume {a} -> {b}"]
            assert r["loaded_optimizer"] and r["names_equal"] and r["n_expert_tensors"] > 0, r
            assert r["step_change"] > 1e-4, r
            assert r["max_abs_diff"] <= 1e-6, r


def test_conversion_memory_is_bounded(tmp_path):
    """A 117 MB model (largest tensor 16 MiB): each direction's peak memory (RSS; anonymous
    memory while megatron writes the checkpoint) stays below the process baseline plus 1.5x
    the largest tensor, and the round trip is bit-exact."""
    from areal_mega.models.tiny import make_tiny_model

    hf = make_tiny_model(
        tmp_path / "hf",
        arch="llama",
        hidden_size=1024,
        intermediate_size=4096,
        num_layers=2,
        num_heads=16,
        num_kv_heads=4,
        tie_word_embeddings=False,
    )
    reports = []
    for cmd in (
        [
            "tools/convert_hf_to_mcore.py",
            "--hf-dir",
            str(hf),
            "--out",
            str(tmp_path / "m"),
            "--tp",
            "2",
            "--pp",
            "2",
        ],
        [
            "tools/convert_mcore_to_hf.py",
            "--mcore-dir",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "hf2"),
        ],
    ):
        rep = tmp_path / f"report{len(reports)}.json"
        p = subprocess.run(
            [sys.executable, *cmd, "--report", str(rep)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-4000:]
        assert "100%" in p.stderr  # the progress bar ran
        reports.append(json.loads(rep.read_text()))
    model_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    for r in reports:
        over = r["peak_rss"] - r["baseline_rss"]
        if "save_anon_peak" in r:
            # HF -> megatron: megatron-core 0.19 writes the checkpoint from threads of this
            # process, which makes the memory-mapped staged tensors' page-cache pages resident
            # here (RSS + the model size, nothing allocated): up to the save RSS counts, during
            # it the anonymous memory (common/proc_memory.py)
            over = max(
                r["peak_rss_before_save"] - r["baseline_rss"],
                r["save_anon_peak"] - r["save_anon_baseline"],
            )
        print(
            f"peak over baseline {over / 2**20:.1f} MiB, largest tensor "
            f"{r['largest_tensor_bytes'] / 2**20:.1f} MiB, model {model_bytes / 2**20:.0f} MiB"
        )
        assert r["largest_tensor_bytes"] == 16 * 2**20
        assert over < 1.5 * r["largest_tensor_bytes"], r
    assert compare(load_all(hf), load_all(tmp_path / "hf2")) == []

"""bench/vs_trl/run.py's pure helpers (no TRL needed): step walls from end times, the median after
the warm-up step, the speed ratio and target, the parsing of both sides' step logs, the table,
the tokenizer every id of the 135M vocabulary decodes with, the assets (RL and SFT files),
the missing-env message, the model FLOPs, the matmul peaks and the grid's table."""

import importlib
import json
import math
import os

import pytest


@pytest.fixture(scope="module")
def vs():
    return importlib.import_module("bench.vs_trl.run")


def test_step_walls_and_median_after_warmup(vs):
    assert vs.step_walls([10.0, 12.5, 14.0, 17.0], first=4.0) == [4.0, 2.5, 1.5, 3.0]
    assert vs.step_walls([], first=1.0) == []
    assert vs.median_after_warmup([9.0, 1.0, 3.0, 2.0]) == 2.0  # the 9 s warm-up left out
    assert vs.median_after_warmup([5.0]) == 5.0  # one step: itself
    assert math.isnan(vs.median_after_warmup([]))


def test_speed_ratio_and_target(vs):
    assert vs.speed_ratio(12.0, 4.0) == (3.0, True)  # the target is 3x
    assert vs.speed_ratio(10.0, 4.0) == (2.5, False)
    assert vs.speed_ratio(3.0, 2.0) == (1.5, False)
    assert math.isnan(vs.speed_ratio(3.0, 0.0)[0])


def _ours_rows():
    split = {
        "time/wait_data": 0.5,
        "time/logprobs": 0.0,
        "time/train": 1.0,
        "time/weight_sync": 0.25,
    }
    return [
        {"step": 0, "time": 99.0, "eval/reward": 0.1},  # an evaluation row: skipped
        {
            "step": 2,
            "time": 106.0,
            "time/step": 2.0,
            "reward/mean": 0.2,
            "n_tokens_total": 110.0,
            "mem/trainer_peak_rss_gib": 1.5,
            **split,
        },
        {
            "step": 1,
            "time": 103.0,
            "time/step": 3.0,
            "reward/mean": 0.1,
            "n_tokens_total": 100.0,
            "mem/trainer_peak_rss_gib": 1.0,
            **split,
        },
        {
            "step": 3,
            "time": 108.0,
            "time/step": 1.9,
            "reward/mean": 0.3,
            "n_tokens_total": 120.0,
            "mem/trainer_peak_rss_gib": 1.2,
            **split,
        },
    ]


def test_ours_steps_and_summary(vs):
    steps = vs.ours_steps(_ours_rows())
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["wall"] for r in steps] == [3.0, 3.0, 2.0]  # from the end times, step 1 own
    s = vs.side_summary(steps, samples_per_step=8)
    assert s["s_per_step"] == 2.5 and s["samples_per_s"] == 8 / 2.5
    assert s["tokens_per_step"] == 115.0 and s["tokens_per_s"] == 115.0 / 2.5
    assert s["split"] == {"wait_data": 0.5, "logprobs": 0.0, "train": 1.0, "weight_sync": 0.25}
    assert s["train_proc_peak_rss_gib"] == 1.5 and s["rewards"] == [0.1, 0.2, 0.3]


def test_trl_steps_tokens_and_split(vs):
    rows = [
        {
            "step": 2,
            "wall": 4.0,
            "reward": 0.5,
            "num_tokens": 250.0,
            "generate_s": 1.0,
            "rollout_s": 1.5,
            "peak_rss_gib": 2.0,
        },
        {
            "step": 1,
            "wall": 6.0,
            "reward": 0.25,
            "num_tokens": 100.0,
            "generate_s": 2.0,
            "rollout_s": 2.5,
            "peak_rss_gib": 1.0,
        },
    ]
    steps = vs.trl_steps(rows)
    assert [r["tokens"] for r in steps] == [100.0, 150.0]  # from TRL's cumulative count
    assert steps[1]["split"] == {"generate": 1.0, "rollout_rest": 0.5, "train": 2.5}
    s = vs.side_summary(steps, samples_per_step=4)
    assert s["s_per_step"] == 4.0 and s["tokens_per_step"] == 150.0
    assert s["walls"] == [6.0, 4.0]


def test_report_prints_both_sides_ratio_and_verdict(vs):
    ours = vs.side_summary(vs.ours_steps(_ours_rows()), 8)
    trl = vs.side_summary(
        vs.trl_steps(
            [
                {
                    "step": 1,
                    "wall": 9.0,
                    "reward": None,
                    "num_tokens": None,
                    "generate_s": 5.0,
                    "rollout_s": 6.0,
                    "peak_rss_gib": None,
                }
            ]
        ),
        8,
    )
    ratio, met = vs.speed_ratio(trl["s_per_step"], ours["s_per_step"])
    res = {
        "cpu": {"model": "X", "isa": "avx2 (no avx512f)", "cpus": [0, 1]},
        "run": {
            "layers": 2,
            "steps": 3,
            "prompts": 2,
            "group": 4,
            "max_new": 8,
            "lr": 1e-4,
            "rl_seed": 3,
        },
        "ours": {
            "summary": ours,
            "wall": 20.0,
            "peak_pss_gib": 3.0,
            "settings": {
                "eta": 1,
                "weight_update": "disk",
                "server_threads": 1,
                "trainer_threads": 1,
            },
        },
        "trl": {
            "summary": trl,
            "wall": 30.0,
            "peak_pss_gib": 2.0,
            "settings": {
                "trl": "1.16.0",
                "torch": "2.13.0",
                "transformers": "5.12.1",
                "config": {"num_generations": 4},
            },
        },
        "ratio": ratio,
        "target_met": met,
    }
    text = vs.report(res)
    assert "TRL s/step / ours s/step = 3.60x" in text and "MET" in text
    assert "TRL 1.16.0" in text and "num_generations=4" in text and "avx2" in text
    assert "  TRL  -" in text  # a step without a reward prints a dash
    assert "RL seed 3" in text


def test_cpu_info_names_an_isa(vs):
    info = vs.cpu_info([0])
    assert info["cpus"] == [0] and info["model"]
    assert info["isa"].split()[0] in ("avx512f", "avx2", "neither")
    assert info["bf16"] in ("amx_bf16", "avx512_bf16", "none")


def test_tokenizer_decodes_every_id_of_the_vocabulary(vs):
    tok = vs.build_tokenizer(49152)
    assert len(tok) == 49152
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    ids = tok("48312=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "48312="
    assert tok.decode([49151]) and tok.decode([1000, 30000]).isdigit()


def test_assets_keep_the_reverse_answers_for_the_sft_warm_start(vs, tmp_path):
    """RL's files answer ``0000`` after the shared instruction; sft.jsonl has the same prompts
    with the reverse task's own answers (what ``--sft-steps`` trains on)."""
    model, data = vs.make_assets(tmp_path, layers=1, seed=3, instruction=5, shape_name="tiny")
    assert (model / "config.json").exists() and (model / "tokenizer.json").exists()
    rl = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    sft = [json.loads(x) for x in (data / "sft.jsonl").read_text().splitlines()]
    assert len(rl) == len(sft) == 2048
    for r, s in zip(rl, sft):
        assert r["prompt"] == s["prompt"] and r["answer"] == "0000"
        digits = s["prompt"][5:-1]
        assert len(s["prompt"]) == 11 and s["prompt"][:5] == rl[0]["prompt"][:5]
        assert s["answer"] == digits[::-1] and s["prompt"].endswith("=")


def test_missing_trl_env_names_make_trl_env(vs, monkeypatch, tmp_path):
    monkeypatch.setattr(vs, "TRL_PYTHON", tmp_path / "absent" / "python")
    with pytest.raises(SystemExit, match="make trl-env"):
        vs.require_trl_env()


def test_trl_side_is_reused_only_for_the_same_machine_and_work(vs, tmp_path):
    run = dict(
        layers=30,
        steps=5,
        prompts=8,
        group=8,
        max_new=16,
        lr=1e-4,
        seed=1,
        reward="r",
        eta=1,
        weight_update="disk",
        instruction=54,
    )
    cpu = {"model": "AMD EPYC", "isa": "avx512f", "cpus": [0, 1]}
    prev = tmp_path / "vs_trl.json"
    prev.write_text(
        json.dumps({"run": run, "cpu": cpu, "trl": {"settings": {"trl": "1.16.0"}, "steps": []}})
    )
    trl = vs.earlier_trl_side(prev, {"run": dict(run, eta=0), "cpu": cpu})  # ours-only: ok
    # a run that also records the bf16 instructions reuses a side recorded without them
    assert vs.earlier_trl_side(prev, {"run": dict(run, eta=0), "cpu": dict(cpu, bf16="none")})
    assert trl["settings"] == {"trl": "1.16.0", "reused_from": str(prev)}
    with pytest.raises(SystemExit, match="max_new, cpu"):
        vs.earlier_trl_side(prev, {"run": dict(run, max_new=8), "cpu": dict(cpu, cpus=[2])})
    with pytest.raises(SystemExit, match="work .instruction."):  # prompts of another shape
        vs.earlier_trl_side(prev, {"run": dict(run, instruction=0), "cpu": cpu})
    with pytest.raises(SystemExit, match="work .rl_seed."):  # another RL seed
        vs.earlier_trl_side(prev, {"run": dict(run, rl_seed=2), "cpu": cpu})
    assert vs.earlier_trl_side(prev, {"run": dict(run, rl_seed=1), "cpu": cpu})  # = seed then
    with pytest.raises(SystemExit, match="work .dtype."):  # an fp32 TRL side for a bf16 run
        vs.earlier_trl_side(prev, {"run": dict(run, dtype="bf16"), "cpu": cpu})
    assert vs.earlier_trl_side(prev, {"run": dict(run, dtype="fp32"), "cpu": cpu})  # = then
    with pytest.raises(SystemExit, match="not a vs_trl.json"):
        vs.earlier_trl_side(tmp_path / "missing.json", {"run": run, "cpu": cpu})


def test_runs_of_other_seeds_and_etas_get_their_own_names(vs):
    from types import SimpleNamespace as NS

    assert vs.run_names(NS(eta=1, seed=1, rl_seed=1, dtype="fp32", max_new=16)) == {
        "ours": "ours",
        "trl": "trl",
        "result": "vs_trl",
    }
    assert vs.run_names(NS(eta=0, seed=1, rl_seed=2, dtype="fp32", max_new=16)) == {
        "ours": "ours-eta0-seed2",
        "trl": "trl-seed2",
        "result": "vs_trl-eta0-seed2",
    }
    # bf16 runs share the fp32 runs' directory and warm start; TRL's side is its own
    assert vs.run_names(NS(eta=0, seed=1, rl_seed=1, dtype="bf16", max_new=16)) == {
        "ours": "ours-bf16-eta0",
        "trl": "trl-bf16",
        "result": "vs_trl-bf16-eta0",
    }
    # and runs of other answer lengths: a whole grid in one --out
    assert vs.run_names(NS(eta=1, seed=1, rl_seed=1, dtype="bf16", max_new=128)) == {
        "ours": "ours-bf16-new128",
        "trl": "trl-bf16-new128",
        "result": "vs_trl-bf16-new128",
    }


def test_model_flops_match_a_hand_count():
    from bench.vs_trl.flops import causal_context, forward_flops, model_dims, step_flops

    cfg = {
        "hidden_size": 4,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 6,
        "vocab_size": 10,
    }
    dims = model_dims(cfg)
    # q 4x4, k and v 4x2 each, o 4x4: 48; gate, up, down 4x6 each: 72; LM head 4x10: 40
    assert dims == {
        "layers": 1,
        "heads": 2,
        "head_dim": 2,
        "matmul_params": 48 + 72 + 40,
        "head_params": 40,
    }
    # per token 2 x 120 layer FLOPs + 2 x 40 head FLOPs, per key 4 x 1 layer x 2 heads x 2 = 16
    assert forward_flops(dims, tokens=3, context=2) == 3 * (240 + 80 + 16 * 2)
    assert forward_flops(dims, tokens=3, context=2, head_tokens=1) == 3 * (240 + 32) + 80
    assert causal_context(5) == 3  # keys 1..5
    f = step_flops(dims, n_samples=2, prompt_len=3, response_len=2)
    # training, one sample per prompt: prompt positions 1..3 attend to 1..3 keys, without the
    # head; completion positions 4, 5 attend to 4, 5 keys, with the head
    per_sample = 3 * 240 + 16 * 6 + 2 * (240 + 80) + 16 * 9
    assert f["prox"] == 2 * per_sample and f["train"] == 3 * f["prox"]
    # generation: the 3 prompt tokens (1, 2, 3 keys) and the first new token fed back (4
    # keys), the head read after the prompt and after the fed-back token
    assert f["generate"] == 2 * (3 * 240 + 16 * 6 + 240 + 16 * 4 + 2 * 80)
    # a group of 2 samples shares its prompt: counted once
    g = step_flops(dims, n_samples=2, prompt_len=3, response_len=2, group=2)
    assert f["prox"] - g["prox"] == 3 * 240 + 16 * 6
    assert f["generate"] - g["generate"] == 3 * 240 + 16 * 6
    moe = dict(cfg, num_experts_per_tok=2, moe_intermediate_size=3, num_experts=8)
    # 2 active experts of width 3 (3 x 4 x 6 = 72 like the dense MLP) and the 4 x 8 router
    assert model_dims(moe)["matmul_params"] == 48 + 72 + 32 + 40


def test_side_flops_and_generation_rate():
    from bench.vs_trl.flops import model_dims, server_generation_flop_s, side_flops, step_flops

    dims = model_dims(
        {
            "hidden_size": 4,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 6,
            "vocab_size": 10,
        }
    )
    split = {"train": 2.0, "logprobs": 0.5}
    steps = [  # 2 samples of 3 prompt + 2 completion tokens; the warm-up step is left out
        {"tokens": 10, "response_len": 2, "n_samples": 2, "split": {"train": 99.0}},
        {"tokens": 10, "response_len": 2, "n_samples": 2, "split": split},
        {"tokens": 10, "response_len": 2, "n_samples": 2, "split": split, "prox_recomputed": True},
    ]
    f = side_flops(steps, dims, 2, {"train": ("train", "train"), "prox": ("prox", "logprobs")})
    one = step_flops(dims, 2, 3, 2)
    assert f["per_step"]["train"] == one["train"] and f["per_step"]["generate"] == one["generate"]
    assert f["per_step"]["prox"] == one["prox"] / 2  # one of the two steps ran it
    assert f["flop_s"]["train"] == 2 * one["train"] / 4.0
    assert f["flop_s"]["prox"] == one["prox"] / 0.5  # only the step that ran it counts
    info = {"prefill_tokens": 3, "tokens_generated": 2, "forward_seconds": 2.0}
    # prefill tokens attend to (3 + 1) / 2 keys, generated ones to 3 + (2 + 1) / 2
    layers = 2 * (dims["matmul_params"] - dims["head_params"])
    want = 3 * (layers + 16 * 2) + 2 * (layers + 2 * dims["head_params"] + 16 * 4.5)
    assert server_generation_flop_s(dims, info, 3, 2) == want / 2.0
    assert server_generation_flop_s(dims, {}, 3, 2) is None


def test_time_to_quality_points(vs):
    from bench.vs_trl import quality

    rows = [
        {"step": 0, "time": 110.0, "eval/pass@1": 0.0, "eval/reward": 0.1, "eval/seconds": 2.0},
        {"step": 1, "time": 113.0, "time/step": 3.0},
        {"step": 2, "time": 120.0, "eval/pass@1": 0.5, "eval/reward": 0.6, "eval/seconds": 3.0},
    ]
    points, spent = quality.ours_quality(rows, t0=100.0)
    # each point's time less every evaluation up to and including its own
    assert spent == 5.0
    assert [(q["step"], q["t"], q["pass@1"], q["reward"]) for q in points] == [
        (0, 8.0, 0.0, 0.1),
        (2, 15.0, 0.5, 0.6),
    ]
    trl_rows = [
        {"step": 1, "time": 205.0, "paused_s": 0.0},
        {"step": 2, "time": 209.0, "paused_s": 1.5},  # a snapshot saved after step 1
    ]
    assert quality.trl_times(trl_rows, begin=203.0, t0=200.0, steps=[0, 2]) == {0: 3.0, 2: 7.5}
    assert quality.eval_steps(10, 4) == [4, 8, 10] and quality.eval_steps(2, 2) == [2]
    assert quality.time_to_reach(points, 0.5) == 15.0 and quality.time_to_reach(points, 0.0) == 8.0
    assert quality.time_to_reach(points, 0.6) is None
    assert quality.time_to_reach(points, 0.6, key="reward") == 15.0
    # a step's wall leaves out the evaluation logged with it
    steps = vs.ours_steps(
        [
            {"step": 1, "time": 113.0, "time/step": 3.0},
            {"step": 2, "time": 120.0, "time/step": 4.0, "eval/seconds": 3.0},
            {"step": 3, "time": 125.0, "time/step": 5.0},  # started after the evaluation
        ]
    )
    assert [r["wall"] for r in steps] == [3.0, 4.0, 5.0]


def test_quality_summary_times_each_side_to_the_others_final():
    from bench.vs_trl.quality import quality_summary

    res = {
        "ours": {
            "quality": [
                {"t": 10.0, "pass@1": 0.0, "reward": 0.1},
                {"t": 20.0, "pass@1": 0.5, "reward": 0.7},
            ]
        },
        "trl": {
            "quality": [
                {"t": 5.0, "pass@1": 0.0, "reward": 0.1},
                {"t": 30.0, "pass@1": 0.25, "reward": 0.8},
            ]
        },
    }
    q = quality_summary(res)
    assert (q["ours_final"], q["trl_final"], q["ours_s_total"], q["trl_s_total"]) == (
        0.5,
        0.25,
        20.0,
        30.0,
    )
    assert q["ours_s_to_trl_final"] == 20.0 and q["trl_s_to_ours_final"] is None
    assert q["ours_s_to_trl_reward_final"] is None and q["trl_s_to_ours_reward_final"] == 30.0
    assert quality_summary({"ours": res["ours"]}) == {}  # no TRL side: nothing to compare


def test_grid_table_rows_ratio_peak_fraction_and_order():
    from bench.vs_trl.table import markdown, table_row

    def res(dtype, max_new, eta, ours_s, trl_s):
        peak = {
            "1": {"float32": 100e9, "bfloat16": 200e9},
            "2": {"float32": 190e9, "bfloat16": 380e9},
        }
        return {
            "run": {"dtype": dtype, "max_new": max_new, "seed": 1, "rl_seed": 1},
            "flops": {
                "peak": peak,
                "ours": {"flop_s": {"train": 50e9}, "threads": {"train": 1}},
                "trl": {"flop_s": {"train": 19e9}, "threads": {"train": 2}},
            },
            "ours": {
                "summary": {"s_per_step": ours_s},
                "settings": {"eta": eta},
                "after": {"pass@1": 0.5, "reward": 0.75},
                "peak_pss_gib": 3.0,
            },
            "trl": {
                "summary": {"s_per_step": trl_s},
                "after": {"pass@1": 0.25, "reward": 0.5},
                "peak_pss_gib": 2.0,
            },
        }

    row = table_row(res("bf16", 128, 0, 4.0, 12.0))
    assert row["ratio"] == 3.0 and row["peak_ours"] == 0.25  # of the bf16 peak on 1 thread
    assert row["mem_ours"] / row["mem_trl"] == 1.5
    fp32 = table_row(res("fp32", 16, 1, 2.0, 5.0))
    assert fp32["peak_ours"] == 0.5 and fp32["peak_trl"] == 0.1  # the fp32 peaks
    ours_only = res("fp32", 16, 0, 2.0, 5.0)
    del ours_only["trl"], ours_only["flops"]["trl"]
    bare = table_row(ours_only)
    assert math.isnan(bare["ratio"]) and math.isnan(bare["peak_trl"])
    # the same grid cell from a shorter SFT warm start (issue 54's "128u") is a row of its own
    short = res("bf16", 128, 0, 4.0, 12.0)
    short["run"]["sft_steps"] = 12
    row["sft_steps"] = 30
    text = markdown([table_row(short), row, bare, fp32]).splitlines()
    assert [ln.split(" | ")[:4] for ln in text[2:]] == [
        ["| fp32", "16", "0", "0"],
        ["| fp32", "16", "0", "1"],
        ["| bf16", "128", "30", "0"],
        ["| bf16", "128", "12", "0"],
    ]
    assert "| 3.00x |" in text[4] and "25% / 5%" in text[4] and text[2].count(" - ") >= 3


def test_matmul_peaks_take_the_better_backend(monkeypatch):
    import torch

    from areal_mega.common import cpu_bf16
    from bench.vs_trl import flops
    from bench.vs_trl.flops import matmul_peak, matmul_peaks

    monkeypatch.setattr(flops, "PEAK_SIZES", (256, 512))
    cpu = sorted(os.sched_getaffinity(0))[:1]
    peaks = matmul_peaks(cpu, [1, 1])["1"]  # one entry per thread count
    for dt in ("float32", "bfloat16"):
        by = peaks[f"{dt}_by_backend"]
        assert all(v > 0 for v in by.values())
        assert peaks[dt] == max(by.values())
    assert "matmul" in peaks["float32_by_backend"]
    if torch.backends.mkldnn.is_available():
        assert "onednn" in peaks["float32_by_backend"]
    # bf16 where this CPU has no bf16 GEMMs: the product the trainer computes there, only
    want = ["widened"] if cpu_bf16.bf16_products_in_fp32() else ["matmul", "onednn"]
    assert sorted(peaks["bfloat16_by_backend"]) == want[: len(peaks["float32_by_backend"])]
    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "fp32")  # that case on any CPU
    assert list(matmul_peaks(cpu, [1])["1"]["bfloat16_by_backend"]) == ["widened"]
    assert matmul_peak("float32", 1, n=32, seconds=0.01, backend="onednn") > 0
    assert matmul_peak("bfloat16", 1, n=32, seconds=0.01, backend="widened") > 0
    with pytest.raises(ValueError, match="backend='mkl'"):
        matmul_peak("float32", 1, n=32, backend="mkl")


def test_grid_table_recount_uses_the_run_model_and_one_peak(tmp_path):
    from bench.vs_trl.flops import model_dims, step_flops
    from bench.vs_trl.table import recount, table_row

    cfg = {
        "hidden_size": 4,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 6,
        "vocab_size": 10,
    }
    (tmp_path / "sft" / "hf_model").mkdir(parents=True)
    (tmp_path / "sft" / "hf_model" / "config.json").write_text(json.dumps(cfg))
    step = {"tokens": 10, "response_len": 2, "n_samples": 2, "split": {"train": 2.0}}
    res = {
        "run": {"prompts": 1, "group": 2, "sft_steps": 3, "max_new": 4, "seed": 1},
        "cpu": {"cpus": [0, 1]},
        "ours": {
            "run_dir": str(tmp_path / "ours"),
            "settings": {"server_threads": 1, "trainer_threads": 1, "eta": 1},
            "steps": [step, step],
            "summary": {"s_per_step": 2.0, "tokens_per_step": 10, "response_len": 2},
            "flops": "stale",
        },
        "flops": {"peak": {"1": {"float32": 1.0}}, "ours": {"flop_s": {"train": 99.0}}},
    }
    recount(res, {"1": {"float32": 40.0}, "2": {"float32": 80.0}})
    train = step_flops(model_dims(cfg), 2, 3, 2, group=2)["train"]  # the prompt counted once
    assert res["flops"]["ours"]["flop_s"]["train"] == train / 2.0
    assert table_row(res)["peak_ours"] == train / 2.0 / 40.0

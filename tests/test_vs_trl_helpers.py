"""bench/vs_trl/run.py's pure helpers (no TRL needed): step walls from end times, the median after
the warm-up step, the speed ratio and target, the parsing of both sides' step logs, the table,
the tokenizer every id of the 135M vocabulary decodes with, the assets (RL and SFT files),
and the missing-env message."""

import importlib
import json
import math

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
    assert vs.speed_ratio(10.0, 4.0) == (2.5, True)
    assert vs.speed_ratio(10.0, 5.0) == (2.0, True)
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
    assert trl["settings"] == {"trl": "1.16.0", "reused_from": str(prev)}
    with pytest.raises(SystemExit, match="max_new, cpu"):
        vs.earlier_trl_side(prev, {"run": dict(run, max_new=8), "cpu": dict(cpu, cpus=[2])})
    with pytest.raises(SystemExit, match="work .instruction."):  # prompts of another shape
        vs.earlier_trl_side(prev, {"run": dict(run, instruction=0), "cpu": cpu})
    with pytest.raises(SystemExit, match="work .rl_seed."):  # another RL seed
        vs.earlier_trl_side(prev, {"run": dict(run, rl_seed=2), "cpu": cpu})
    assert vs.earlier_trl_side(prev, {"run": dict(run, rl_seed=1), "cpu": cpu})  # = seed then
    with pytest.raises(SystemExit, match="not a vs_trl.json"):
        vs.earlier_trl_side(tmp_path / "missing.json", {"run": run, "cpu": cpu})


def test_runs_of_other_seeds_and_etas_get_their_own_names(vs):
    from types import SimpleNamespace as NS

    assert vs.run_names(NS(eta=1, seed=1, rl_seed=1)) == {
        "ours": "ours",
        "trl": "trl",
        "result": "vs_trl",
    }
    assert vs.run_names(NS(eta=0, seed=1, rl_seed=2)) == {
        "ours": "ours-eta0-seed2",
        "trl": "trl-seed2",
        "result": "vs_trl-eta0-seed2",
    }

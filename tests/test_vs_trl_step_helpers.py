"""bench/vs_trl/step.py's helpers (no TRL needed): TRL's batch as the intake's trajectories,
the per-tensor comparisons with the embedding's pad row left out, AdamW's first step, the
summaries; and bench/vs_trl/seeds.py's pooling of several runs' reward curves."""

import importlib
import json

import numpy as np
import pytest
import torch

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def step():
    return importlib.import_module("bench.vs_trl.step")


def test_trl_batch_becomes_groups_of_trajectories(step):
    samples = [
        {
            "prompt_ids": [5, 6, 7],
            "completion_ids": [8, 1],
            "logprobs": [-0.5, -1.0],
            "reward": 1.0,
            "advantage": 0.7,
        },
        {
            "prompt_ids": [5, 6, 7],
            "completion_ids": [9, 9, 9],
            "logprobs": [-2.0] * 3,
            "reward": 0.0,
            "advantage": -0.7,
        },
        {
            "prompt_ids": [4],
            "completion_ids": [1],
            "logprobs": [-0.1],
            "reward": 0.5,
            "advantage": 0.0,
        },
        {
            "prompt_ids": [4],
            "completion_ids": [3],
            "logprobs": [-0.2],
            "reward": 0.5,
            "advantage": 0.0,
        },
    ]
    trajs = step.trajectories({"samples": samples, "group": 2, "eos_id": 1})
    assert [t.group_id for t in trajs] == ["g0", "g0", "g1", "g1"]
    assert [t.finish_reason for t in trajs] == ["stop", "length", "stop", "length"]
    t = trajs[0]
    assert t.input_ids.tolist() == [5, 6, 7, 8, 1] and t.prompt_len == 3
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1]
    np.testing.assert_allclose(t.logprobs[3:], [-0.5, -1.0])  # behaviour logprobs
    assert t.versions[3:].tolist() == [0, 0] and t.reward == 1.0


def test_differences_leave_out_only_the_pad_row(step):
    ref = {EMBED: torch.ones(4, 3), "w": torch.full((2,), 2.0)}
    ours = {EMBED: torch.ones(4, 3), "w": torch.full((2,), 2.2)}
    ours[EMBED][0] = 5.0  # the pad row: lookups of pad
    d = step.rel_diffs(ours, ref, pad_id=0)
    assert d[EMBED] == 0.0 and d["w"] == pytest.approx(0.1)
    assert step.rel_diffs(ours, ref)[EMBED] > 1.0  # counted without pad_id
    clipped = {"w": torch.full((2,), 1.0)}  # TRL's gradient clipped by 1/2
    unclipped = {n: g / step.clip_factor(2.0 - 1e-6, 1.0) for n, g in clipped.items()}
    assert step.rel_diffs(ours, unclipped)["w"] == pytest.approx(0.1)
    assert step.clip_factor(0.5, 1.0) == 1.0  # below the bound: no clipping
    zero = step.rel_diffs({"z": torch.tensor([0.5])}, {"z": torch.zeros(1)})
    assert zero["z"] == pytest.approx(0.5)  # a zero reference: absolute


def test_adamw_first_step_is_lr_times_the_sign_after_clipping(step):
    g = {"w": torch.tensor([2.0, -2.0, 0.0, 1e-8])}
    u = step.adamw_first_step(g, grad_norm=4.0, lr=0.1, max_norm=1.0)["w"]  # clipped by 1/4
    assert u.tolist() == pytest.approx([-0.1, 0.1, 0.0, -0.1 * 2.5e-9 / (2.5e-9 + 1e-8)], rel=1e-5)
    # the same update as torch's AdamW after clip_grad_norm_
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = g["w"].double().clone()
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    torch.optim.AdamW([p], lr=0.1, weight_decay=0.0).step()
    norm = float(g["w"].double().norm())
    assert torch.allclose(p.detach(), step.adamw_first_step(g, norm, 0.1, 1.0)["w"], rtol=1e-6)


def test_norm_without_pad_and_summary(step):
    grads = {EMBED: torch.tensor([[3.0, 0.0], [0.0, 4.0]]), "b": torch.tensor([0.0])}
    assert step.norm_without_pad(grads, 0) == pytest.approx(4.0)
    assert step.norm_without_pad(grads, None) == pytest.approx(5.0)
    s = step.summarise({"a": 0.1, "b": 0.3, "c": 0.2})
    assert s == {"worst": 0.3, "tensor": "b", "median": 0.2, "tensors": 3}
    assert step.summarise({"a": 0.99, "b": 1.0}, worst=min)["tensor"] == "a"


def _run(seed, eta, ours, trl, rl_seed=True):
    run = {"seed": 1, **({"rl_seed": seed} if rl_seed else {})}
    return {
        "run": run,
        "ours": {"settings": {"eta": eta}, "summary": {"rewards": ours, "s_per_step": 10.0 + eta}},
        "trl": {"summary": {"rewards": trl, "s_per_step": 30.0}},
    }


def test_seeds_pool_curves_per_label_and_seed():
    seeds = importlib.import_module("bench.vs_trl.seeds")
    runs = [
        _run(1, 1, [0.1, 0.3], [0.2, 0.4], rl_seed=False),  # older: RL seed = seed
        _run(1, 0, [0.2, 0.2], [0.2, 0.4]),  # TRL reused: counted once
        _run(2, 0, [0.4, None, 0.6], [0.0, 0.2]),
    ]  # a step without a reward
    c = seeds.curves(runs)
    assert sorted(c) == ["TRL", "ours eta=0", "ours eta=1"]
    assert sorted(c["TRL"]) == [1, 2] and sorted(c["ours eta=0"]) == [1, 2]
    p = seeds.pooled(c["ours eta=0"])
    assert p["seeds"] == 2 and p["mean"] == pytest.approx([0.3, 0.2, 0.6])
    assert p["low"] == pytest.approx([0.2, 0.2, 0.6]) and p["high"][0] == pytest.approx(0.4)
    assert p["per_seed"] == pytest.approx({1: 0.2, 2: 0.5}) and p["overall"] == pytest.approx(0.35)
    text = seeds.report({"TRL": seeds.pooled(c["TRL"])})
    assert "TRL (2 seeds, median 30.00 s/step): mean reward 0.200" in text
    assert "seed 1: 0.300, seed 2: 0.100" in text and "per step 0.100 0.300" in text


def test_seeds_pool_runs_made_without_trl(tmp_path):
    """``--ours-only`` runs (e.g. bf16 seeds where TRL's side cannot run) pool their curves of
    ours; a run without ours' side is still refused by name."""
    seeds = importlib.import_module("bench.vs_trl.seeds")
    runs = [_run(1, 1, [0.1, 0.3], None), _run(2, 1, [0.3, 0.5], None)]
    for r in runs:
        del r["trl"]
    c = seeds.curves(runs)
    assert sorted(c) == ["ours eta=1"] and sorted(c["ours eta=1"]) == [1, 2]
    assert seeds.pooled(c["ours eta=1"])["mean"] == pytest.approx([0.2, 0.4])
    no_ours = tmp_path / "vs_trl.json"
    no_ours.write_text(json.dumps({k: v for k, v in runs[0].items() if k != "ours"}))
    with pytest.raises(SystemExit, match="lacks 'ours'"):
        seeds.main([str(no_ours)])


def test_seeds_lag_check_compares_eta1_one_step_later_with_eta0():
    seeds = importlib.import_module("bench.vs_trl.seeds")

    def band(mean, half):
        return {
            "mean": mean,
            "low": [None if v is None else v - half for v in mean],
            "high": [None if v is None else v + half for v in mean],
        }

    eta0 = band([0.1, 0.3, 0.5, 0.7], 0.1)
    # eta 1 is eta 0 one step later, and a step that lacks a reward is left out
    eta1 = band([None, 0.1, 0.3, 0.5], 0.05)
    check = seeds.lag_check({"ours eta=0": eta0, "ours eta=1": eta1})
    assert check["shifted"] == pytest.approx(0.0)
    assert check["same_step"] == pytest.approx(-0.2)  # steps 2..4: 0.1-0.3, 0.3-0.5, 0.5-0.7
    assert check["spread"] == pytest.approx((4 * 0.1 + 3 * 0.05) / 7)
    (line,) = seeds.lag_lines(check)
    assert "one step later +0.000" in line and "same step -0.200" in line
    assert seeds.lag_check({"ours eta=0": eta0}) == {} and seeds.lag_lines({}) == []

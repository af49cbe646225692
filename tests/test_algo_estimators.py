"""verl's advantage estimators rloo, opo, grpo_passk, reinforce_plus_plus and
reinforce_plus_plus_baseline (areal_mega.algo.estimators) against a frozen table of verl's own
outputs, plus hand-computed values of the conventions where we differ from verl on purpose.

The table ``tests/data/verl_estimators.npz`` was made by running verl's functions
(``verl/trainer/ppo/core_algos.py``; the commit is in the table's ``meta``) on seeded random
batches in float64: groups of 1 to 16, ties, constant rewards, masked tokens (holes), varied
lengths. verl is not installed here; to regenerate the table, extract verl's source outside
the repository and run ``tests/data/make_verl_estimator_table.py --verl <dir> --commit <sha>``
(its docstring has the full recipe and says how each batch's inputs are arranged).
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_mega.algo import compute_advantages
from areal_mega.algo.estimators import (
    discounted_returns,
    estimator_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten_like_verl,
)
from areal_mega.config import AlgorithmConfig

TABLE = Path(__file__).parent / "data" / "verl_estimators.npz"
TOL = 1e-6


def _table():
    data = np.load(TABLE)
    meta = json.loads(str(data["meta"]))
    batches = []
    for k in range(meta["n_batches"]):
        pre = f"b{k}__"
        batches.append({key[len(pre) :]: data[key] for key in data.files if key.startswith(pre)})
    return meta, batches


META, BATCHES = _table()


def pack(batch, token_rewards):
    """verl's [bs, L] response layout -> our packed layout: row b becomes a sequence of
    b % 3 prompt tokens (loss mask 0) then its response columns, trailing padding trimmed to
    b % 2 columns. Returns (packed inputs, flat index of each kept response cell)."""
    mask = batch["mask"]
    bs, L = mask.shape
    toks, masks, cells, cu = [], [], [], [0]
    for b in range(bs):
        last = int(np.nonzero(mask[b])[0].max())
        cols = min(L, last + 1 + b % 2)
        toks += [0.0] * (b % 3) + list(token_rewards[b, :cols])
        masks += [0] * (b % 3) + list(mask[b, :cols])
        cells += [-1] * (b % 3) + [b * L + c for c in range(cols)]
        cu.append(len(toks))
    tok = torch.tensor(toks, dtype=torch.float64)
    m = torch.tensor(masks, dtype=torch.bool)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    seq = torch.tensor(token_rewards.sum(axis=1), dtype=torch.float64)
    return dict(
        tok=tok, mask=m, cu=cu_t, seq=seq, group=torch.from_numpy(batch["index"].astype(np.int64))
    ), np.array(cells)


def ours(batch, name, token_rewards=None):
    """Our advantages in verl's [bs, L] layout (asserting 0 on prompt tokens)."""
    tr = batch["token_rewards"] if token_rewards is None else token_rewards
    p, cells = pack(batch, tr)
    adv = estimator_advantages(
        name,
        p["seq"],
        p["tok"],
        p["mask"],
        p["cu"],
        p["group"],
        gamma=float(batch["gamma"]),
        use_std=bool(batch["use_std"]),
    )
    assert adv.dtype == torch.float64
    adv = adv.numpy()
    assert not adv[cells < 0].any() and not adv[~p["mask"].numpy()].any()
    out = np.zeros(batch["mask"].size)
    out[cells[cells >= 0]] = adv[cells >= 0]
    return out.reshape(batch["mask"].shape)


def singleton_rows(batch):
    idx = batch["index"]
    return np.array([(idx == g).sum() == 1 for g in idx])


def test_table_is_verls_and_small():
    assert len(META["verl_commit"]) == 40 and META["verl_repo"] == "volcengine/verl"
    assert TABLE.stat().st_size < 200_000
    sizes = set()
    for b in BATCHES:
        idx = b["index"]
        sizes |= {int((idx == g).sum()) for g in np.unique(idx)}
    assert 1 in sizes and max(sizes) >= 12  # groups of 1 .. 16
    assert any(b["holes"] for b in BATCHES) and any(not b["holes"] for b in BATCHES)


@pytest.mark.parametrize("k", range(len(BATCHES)))
@pytest.mark.parametrize("name", ["rloo", "opo"])
def test_group_baselines_match_verl(name, k):
    b = BATCHES[k]
    got, ref = ours(b, name), b[name]
    single = singleton_rows(b)
    np.testing.assert_allclose(got[~single], ref[~single], atol=TOL, rtol=0)
    # our convention: a singleton gets 0; verl's keeps its reward R on every response token
    assert not got[single].any()
    r = b["token_rewards"].sum(axis=1)
    np.testing.assert_allclose(ref[single], (r[:, None] * b["mask"])[single], atol=TOL)


@pytest.mark.parametrize("k", range(len(BATCHES)))
def test_grpo_passk_matches_verl(k):
    b = BATCHES[k]
    got = ours(b, "grpo_passk")
    np.testing.assert_allclose(got, b["grpo_passk"], atol=TOL, rtol=0)
    assert not got[singleton_rows(b)].any()  # verl raises on a singleton group


@pytest.mark.parametrize("k", range(len(BATCHES)))
def test_reinforce_pp_baseline_matches_verl(k):
    b = BATCHES[k]
    got = ours(b, "reinforce_plus_plus_baseline", b["rfppb_input"])
    np.testing.assert_allclose(got, b["reinforce_plus_plus_baseline"], atol=TOL, rtol=0)
    # a singleton's own reward never reaches the batch (verl would whiten it in)
    np.testing.assert_allclose(ours(b, "reinforce_plus_plus_baseline"), got, atol=1e-12)


@pytest.mark.parametrize("k", [k for k, b in enumerate(BATCHES) if not b["holes"]])
def test_reinforce_pp_matches_verl(k):
    b = BATCHES[k]
    np.testing.assert_allclose(
        ours(b, "reinforce_plus_plus"), b["reinforce_plus_plus"], atol=TOL, rtol=0
    )


def test_reinforce_pp_skips_masked_tokens():
    """Our convention: the returns run over the loss tokens in order, across a masked span
    (tool output); verl restarts at every masked token."""
    tok = torch.tensor([0.0, 0.5, 0.0, 9.0, 1.0, 0.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    cu = torch.tensor([0, 5, 7])
    g = discounted_returns(tok, mask, cu, gamma=0.5)
    expect = [0.0, 0.5 + 0.5 * 0.5, 0.5, 0.0, 1.0, 0.0, 2.0]  # token 3's reward ignored
    np.testing.assert_allclose(g.numpy(), expect)
    vals = torch.tensor([0.75, 0.5, 1.0, 2.0], dtype=torch.float64)
    mean, var = vals.sum() / (4 + 1e-8), None
    var = ((vals - mean) ** 2).sum() / (4 + 1e-8) * 4 / 3
    adv = reinforce_pp_advantages(tok, mask, cu, gamma=0.5)
    np.testing.assert_allclose(adv[mask].numpy(), ((vals - mean) / (var + 1e-8).sqrt()).numpy())
    assert not adv[~mask].any()


def test_hand_values():
    r = torch.tensor([1.0, 0.0, 1.0, 2.0, 5.0, 3.0, 3.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 2, 2, 2])
    np.testing.assert_allclose(rloo_advantages(r, g).numpy(), [0.5, -1, 0.5, 0, 2, -1, -1])
    lens = torch.tensor([1, 2, 3, 4, 1, 1, 2])
    b0, b2 = (1 * 1 + 3 * 1) / 6, (5 + 3 + 6) / 4
    np.testing.assert_allclose(
        opo_advantages(r, g, lens).numpy(), [1 - b0, -b0, 1 - b0, 0, 5 - b2, 3 - b2, 3 - b2]
    )
    std2 = np.std([5.0, 3.0, 3.0], ddof=1)
    np.testing.assert_allclose(
        grpo_passk_advantages(r, g).numpy(), [0, 0, 0, 0, 2 / (std2 + 1e-6), 0, 0]
    )
    np.testing.assert_allclose(
        grpo_passk_advantages(r, g, use_std=False).numpy(), [0, 0, 0, 0, 2, 0, 0]
    )  # group 0: tied maximum -> all 0
    x = torch.tensor([3.0, 3.0, 3.0])
    assert whiten_like_verl(x, torch.tensor([1, 0, 0])).abs().max() < 1e-7


@pytest.mark.parametrize(
    "name", ["rloo", "opo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
)
def test_compute_advantages_dispatch(name):
    """The packed trainer entry (float32) gives the pure function's numbers."""
    b = BATCHES[0]
    p, _ = pack(b, b["token_rewards"])
    rewards = p["seq"].float()
    batch = {
        "loss_mask": p["mask"],
        "cu_seqlens": p["cu"],
        "rewards": rewards,
        "group_index": p["group"],
    }
    cfg = dataclasses.replace(AlgorithmConfig(), adv_estimator=name, gamma=0.9)
    out, stats = compute_advantages(batch, cfg)
    tok = torch.zeros_like(p["tok"])
    last = [
        int(np.nonzero(p["mask"][s:e].numpy())[0].max()) + s
        for s, e in zip(p["cu"][:-1].tolist(), p["cu"][1:].tolist())
    ]
    tok[last] = p["seq"]
    ref = estimator_advantages(name, p["seq"], tok, p["mask"], p["cu"], p["group"], gamma=0.9)
    np.testing.assert_allclose(out["advantages"].double().numpy(), ref.numpy(), atol=1e-5)
    assert out["advantages"].dtype == torch.float32 and stats["advantage_std"] > 0

"""Regenerate ``tests/data/verl_estimators.npz``: verl's own outputs of its advantage
estimators ``rloo``, ``opo``, ``grpo_passk``, ``reinforce_plus_plus`` and
``reinforce_plus_plus_baseline`` on seeded random batches, the frozen reference of
``tests/test_algo_estimators.py`` (verl is not a dependency of this project).

This script holds no verl code: it imports ``verl.trainer.ppo.core_algos`` from the checkout
given on the command line and calls the registered functions. How the table was made::

    # a verl source tree outside this repository, e.g. from a clone of volcengine/verl:
    git --git-dir=<verl>/.git archive <commit> verl | tar -x -C /tmp/verlsrc
    # what core_algos needs to import, installed aside (no dependency tree):
    pip install --target /tmp/verldeps --no-deps tensordict omegaconf \\
        antlr4-python3-runtime==4.9.3 pyyaml cloudpickle pyvers orjson codetiming
    PYTHONPATH=/tmp/verldeps python tests/data/make_verl_estimator_table.py \\
        --verl /tmp/verlsrc --commit <commit> --out tests/data/verl_estimators.npz

(torch, numpy, packaging and transformers come from the project's environment.) Two imports
that core_algos pulls in but never uses are shimmed below when missing: ``ray`` (imported by
``verl.protocol``) and ``transformers.AutoModelForVision2Seq`` (gone in transformers 5, named by
``verl.utils.model``).

Batch k (keys ``b<k>__<field>``): ``token_rewards`` [bs, L] float64 (the outcome reward on the
last response-mask token, plus small per-token rewards in some batches), ``mask`` [bs, L] the
response mask (a valid prefix, with interior holes in some batches), ``index`` [bs] the prompt
group, ``gamma``, ``use_std`` (verl's ``norm_adv_by_std_in_grpo``), then verl's advantages
[bs, L] per estimator. Where verl's convention differs from ours on purpose the input is
arranged so that the comparison is meaningful, and the test says how:

- ``grpo_passk`` raises on a singleton group: verl runs on the rows of groups of two or more
  (groups are independent), singleton rows hold 0;
- ``reinforce_plus_plus_baseline`` keeps R for a singleton and whitens over the whole batch:
  ``rfppb_input`` is ``token_rewards`` with singleton rows zeroed, where both conventions give
  the singleton 0, and verl ran on that;
- ``reinforce_plus_plus`` restarts its returns at masked tokens: only batches without holes
  (``holes`` False) have it.
"""

from __future__ import annotations

import argparse
import json
import sys
import types

import numpy as np
import torch

SEED = 20260129
ESTIMATORS = ("rloo", "opo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _shim_unused_imports() -> None:
    """Let core_algos import without ray / with transformers 5 (neither is used by it)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        ray = types.ModuleType("ray")
        ray.ObjectRef = type("ObjectRef", (), {})
        ray.remote = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)
        sys.modules["ray"] = ray
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq"):
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText


def make_batches(rng: np.random.Generator) -> list[dict]:
    """The seeded input batches: group sizes 1..16, binary (ties), continuous and constant
    rewards, varied valid lengths, holes in the mask, dense token rewards."""
    specs = [  # (min group, max group, reward kind, holes, dense, gamma, use_std, L)
        (1, 16, "binary", False, False, 1.0, True, 8),
        (2, 16, "continuous", False, False, 0.9, True, 10),
        (1, 8, "tied", True, False, 1.0, False, 9),
        (2, 6, "constant", False, False, 1.0, True, 6),
        (1, 16, "binary", False, True, 0.7, True, 7),
        (1, 4, "continuous", True, True, 1.0, True, 12),
        (2, 16, "tied", False, False, 0.95, False, 5),
        (1, 3, "group_constant", False, False, 1.0, True, 8),
    ]
    out = []
    for lo, hi, kind, holes, dense, gamma, use_std, L in specs:
        sizes = []
        while sum(sizes) < 24:
            sizes.append(int(rng.integers(lo, hi + 1)))
        if lo == 1 and 1 not in sizes:
            sizes[0] = 1
        index = np.repeat(np.arange(len(sizes)), sizes)
        index = index[rng.permutation(index.size)]  # groups interleaved
        bs = index.size
        if kind == "binary":
            score = rng.integers(0, 2, bs).astype(np.float64)
        elif kind == "tied":
            score = rng.integers(0, 3, bs) * 0.5
        elif kind == "constant":
            score = np.full(bs, 0.7)
        elif kind == "group_constant":
            score = rng.normal(size=len(sizes))[index]
            score[index == 0] = rng.normal(size=(index == 0).sum())
        else:
            score = rng.normal(size=bs)
        mask = np.zeros((bs, L), np.int8)
        tok = np.zeros((bs, L))
        for b in range(bs):
            v = int(rng.integers(1, L + 1))
            mask[b, :v] = 1
            if holes and v >= 4:
                a = int(rng.integers(1, v - 2))
                mask[b, a : a + int(rng.integers(1, v - 1 - a))] = 0
            if dense:
                tok[b] = rng.normal(scale=0.1, size=L) * mask[b]
            tok[b, v - 1] += score[b]
        out.append(
            dict(
                token_rewards=tok, mask=mask, index=index, gamma=gamma, use_std=use_std, holes=holes
            )
        )
    return out


def run_verl(core_algos, batch: dict) -> dict:
    """verl's advantages for one batch (see the module docstring for the arranged inputs)."""
    from omegaconf import OmegaConf

    tok = torch.tensor(batch["token_rewards"], dtype=torch.float64)
    mask = torch.tensor(batch["mask"], dtype=torch.float64)
    index = batch["index"]
    cfg = OmegaConf.create({"gamma": batch["gamma"], "norm_adv_by_std_in_grpo": batch["use_std"]})
    fn = core_algos.get_adv_estimator_fn
    res = {}
    for name in ("rloo", "opo"):
        res[name] = fn(name)(
            token_level_rewards=tok.clone(), response_mask=mask, index=index, config=cfg
        )[0]
    sizes = {g: int((index == g).sum()) for g in np.unique(index)}
    multi = np.array([sizes[g] > 1 for g in index])
    passk = torch.zeros_like(tok)
    rows = torch.from_numpy(np.nonzero(multi)[0])
    passk[rows] = fn("grpo_passk")(
        token_level_rewards=tok[rows].clone(),
        response_mask=mask[rows],
        index=index[multi],
        config=cfg,
    )[0]
    res["grpo_passk"] = passk
    rfppb_in = tok.clone()
    rfppb_in[torch.from_numpy(~multi)] = 0.0
    res["rfppb_input"] = rfppb_in
    res["reinforce_plus_plus_baseline"] = fn("reinforce_plus_plus_baseline")(
        token_level_rewards=rfppb_in.clone(), response_mask=mask, index=index, config=cfg
    )[0]
    if not batch["holes"]:
        res["reinforce_plus_plus"] = fn("reinforce_plus_plus")(
            token_level_rewards=tok.clone(), response_mask=mask, config=cfg
        )[0]
    return {k: v.numpy() for k, v in res.items()}


def main() -> None:
    """Parse the command line, import verl from ``--verl``, write the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl", required=True, help="directory holding the verl package")
    ap.add_argument("--commit", required=True, help="the verl commit that directory is")
    ap.add_argument("--out", default="tests/data/verl_estimators.npz")
    args = ap.parse_args()
    sys.path.insert(0, args.verl)
    _shim_unused_imports()
    import verl.trainer.ppo.core_algos as core_algos

    batches = make_batches(np.random.default_rng(SEED))
    arrays = {}
    for k, batch in enumerate(batches):
        for key, val in {**batch, **run_verl(core_algos, batch)}.items():
            arrays[f"b{k}__{key}"] = np.asarray(val)
    meta = {
        "verl_repo": "volcengine/verl",
        "verl_commit": args.commit,
        "verl_file": "verl/trainer/ppo/core_algos.py",
        "n_batches": len(batches),
        "seed": SEED,
        "torch": torch.__version__,
        "dtype": "float64",
        "generator": "tests/data/make_verl_estimator_table.py",
    }
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out}: {len(batches)} batches, verl {args.commit}")


if __name__ == "__main__":
    main()

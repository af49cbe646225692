"""Regenerate ``verl_loss_table.json``: verl's own policy-loss functions on seeded random batches.

    python tests/data/make_verl_loss_table.py /path/to/verl-source [--commit SHA] [--out FILE]

``/path/to/verl-source`` is a directory holding verl's ``verl/`` package (e.g.
``git --git-dir=<verl mirror> archive HEAD verl | tar -x -C /tmp/verlsrc``). verl's top-level
``verl/__init__.py`` (which pulls in ray, the DataProto protocol, ...) is bypassed: only
``verl.trainer.ppo.core_algos`` and ``verl.workers.config`` are imported. Unrelated imports they
drag in are stubbed here (``ray``; transformers names removed in transformers 5); beyond those
this needs torch, omegaconf, tensordict (+ pyvers, cloudpickle, orjson) and codetiming.

The table holds the inputs (so the test does not depend on torch's RNG), the loss and its
gradient with respect to ``log_prob`` for verl's ``vanilla`` (PPO, dual clip), ``cispo`` and
``sapo`` losses, each with ``token-mean`` and ``seq-mean-token-mean`` aggregation (SAPO:
verl forces the latter), on-policy (old = behaviour) and decoupled (old = proximal, verl's
``rollout_is_weights`` = π_prox/π_behav). Consumed by tests/test_algo_objectives.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from unittest import mock

import torch

B, L = 4, 10
SCALES = (0.1, 1.0, 8.0)  # spread of logπ_θ − logπ_old: near on-policy .. extreme
EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 3.0
TAU_POS, TAU_NEG = 1.0, 1.05
AGGS = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean"}


def import_verl(root: str):
    """verl's core_algos and ActorConfig from the source tree at ``root``."""
    pkg = types.ModuleType("verl")
    pkg.__path__ = [str(Path(root) / "verl")]
    sys.modules["verl"] = pkg
    for name in (
        "ray",
        "ray.util",
        "ray.actor",
        "ray.util.placement_group",
        "ray.util.scheduling_strategies",
        "ray.experimental",
        "ray._private",
    ):
        sys.modules.setdefault(name, mock.MagicMock(name=name))
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq"):
        transformers.AutoModelForVision2Seq = type("AutoModelForVision2Seq", (), {})
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    return core_algos, ActorConfig


def make_inputs(seed: int, scale: float) -> dict:
    """One random padded batch [B, L]: varied lengths, holes in the mask, a fully masked row,
    a few extreme log-ratios (beyond the ±20 clamp) and zero advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[-1] = L
    pos = torch.arange(L)[None, :]
    mask = (pos < lengths[:, None]) & (torch.rand(B, L, generator=g) < 0.8)
    mask[0, 0] = True
    mask[1] = False  # a row with no loss token
    prox = -3.0 * torch.rand(B, L, generator=g, dtype=torch.float64)
    behav = prox + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    logp = prox + scale * torch.randn(B, L, generator=g, dtype=torch.float64)
    if scale > 1:
        logp[2, 0], logp[3, 1] = prox[2, 0] + 25.0, prox[3, 1] - 25.0
    adv = torch.randn(B, L, generator=g, dtype=torch.float64)
    adv[:, ::2] = adv[:, 0:1]  # partly constant per sequence, like GRPO
    adv[0, 1] = 0.0
    return {
        "lengths": lengths.tolist(),
        "mask": mask.to(torch.int64).tolist(),
        "prox_logprobs": prox.tolist(),
        "behav_logprobs": behav.tolist(),
        "logprobs": logp.tolist(),
        "advantages": adv.tolist(),
    }


def run_case(core_algos, ActorConfig, inp: dict, objective: str, agg: str, decoupled: bool):
    """verl's loss and d loss / d log_prob on one batch."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in inp.items() if k != "lengths"}
    mask = t["mask"].bool()
    old = t["prox_logprobs"] if decoupled else t["behav_logprobs"]
    is_w = torch.exp(t["prox_logprobs"] - t["behav_logprobs"]) if decoupled else None
    log_prob = t["logprobs"].clone().requires_grad_(True)
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=EPS_LOW,
        clip_ratio_low=EPS_LOW,
        clip_ratio_high=EPS_HIGH,
        clip_ratio_c=CLIP_C,
        tau_pos=TAU_POS,
        tau_neg=TAU_NEG,
    )
    fn = {
        "ppo": core_algos.compute_policy_loss_vanilla,
        "cispo": core_algos.compute_policy_loss_cispo,
        "sapo": core_algos.compute_policy_loss_sapo,
    }
    loss, metrics = fn[objective](
        old_log_prob=old,
        log_prob=log_prob,
        advantages=t["advantages"],
        response_mask=mask,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=is_w,
    )
    loss.backward()
    return {
        "loss": float(loss.detach()),
        "grad": log_prob.grad.tolist(),
        "clipfrac": float(metrics.get("actor/pg_clipfrac", 0.0)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("verl_root", help="directory containing verl's verl/ package")
    p.add_argument("--commit", default="unknown", help="verl commit the source tree is from")
    p.add_argument("--out", default=str(Path(__file__).with_name("verl_loss_table.json")))
    args = p.parse_args(argv)
    core_algos, ActorConfig = import_verl(args.verl_root)
    torch.set_default_dtype(torch.float64)
    inputs = [make_inputs(100 + i, s) for i, s in enumerate(SCALES)]
    cases = []
    for idx in range(len(inputs)):
        for objective in ("ppo", "cispo", "sapo"):
            for agg in AGGS:
                if objective == "sapo" and agg != "seq-mean-token-mean":
                    continue  # verl's SAPO ignores loss_agg_mode
                for decoupled in (False, True):
                    out = run_case(core_algos, ActorConfig, inputs[idx], objective, agg, decoupled)
                    cases.append(
                        {
                            "inputs": idx,
                            "objective": objective,
                            "verl_agg": agg,
                            "loss_agg": AGGS[agg],
                            "decoupled": decoupled,
                            **out,
                        }
                    )
    table = {
        "verl_commit": args.commit,
        "torch": torch.__version__,
        "params": {
            "eps_low": EPS_LOW,
            "eps_high": EPS_HIGH,
            "dual_clip_c": CLIP_C,
            "tau_pos": TAU_POS,
            "tau_neg": TAU_NEG,
        },
        "inputs": inputs,
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(table, separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

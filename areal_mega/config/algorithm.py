"""The ``algorithm`` section of the experiment config: advantage estimator, policy loss and its
clipping, KL, reward shaping, on-policy distillation's switch and MoE routing replay, with the
rules among its own keys and the routing-replay check against the model. The presets that fill
it in are :mod:`areal_mega.config.presets`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areal_mega.common.errors import ConfigError
from areal_mega.config.presets import PRESETS
from areal_mega.config.schema import _f

__all__ = ["AlgorithmConfig", "check_policy_loss", "check_routing_replay_model"]


@dataclass
class AlgorithmConfig:
    name: str = _f("grpo", choices=["grpo", "ppo", "sft"])
    adv_estimator: str = _f(
        "grpo",
        choices=[
            "grpo",
            "gae",
            "reinforce",
            "rloo",
            "reinforce_plus_plus",
            "reinforce_plus_plus_baseline",
            "grpo_passk",
            "opo",
        ],
    )
    eps_clip_low: float = _f(0.2, lo=0.0)
    eps_clip_high: Optional[float] = _f(None, lo=0.0, doc="clip-higher; None = eps_clip_low")
    dual_clip_c: Optional[float] = _f(None, lo=1.0, lo_open=True)
    decoupled: bool = _f(True, doc="ratio against pi_prox, importance weight pi_prox/pi_behav")
    behav_imp_weight_cap: Optional[float] = _f(5.0, lo=1.0)
    imp_weight_level: str = _f(
        "token",
        choices=["token", "sequence", "geometric"],
        doc="sequence: product over the sequence's tokens; geometric: "
        "per-token geometric mean of that product",
    )
    imp_weight_mode: str = _f(
        "mask",
        choices=["mask", "clamp"],
        doc="mask: drop tokens/sequences above the cap; clamp: min(w, cap)",
    )
    preset: Optional[str] = _f(
        None,
        choices=[None, *PRESETS],
        doc="sets the keys that define an algorithm (docs/algorithms.md); explicit keys win",
    )
    policy_loss: str = _f(
        "ppo",
        choices=["ppo", "gspo", "cispo", "sapo"],
        doc="ppo: token-ratio clip; gspo: sequence-ratio clip; cispo: clipped "
        "detached IS weight (REINFORCE form); sapo: soft gate",
    )
    ratio_level: str = _f(
        "token",
        choices=["token", "sequence"],
        doc="sequence = GSPO; must agree with policy_loss (gspo <=> sequence)",
    )
    sapo_tau_pos: float = _f(1.0, lo=0.0, lo_open=True, doc="SAPO gate temperature, A > 0")
    sapo_tau_neg: float = _f(1.05, lo=0.0, lo_open=True, doc="SAPO gate temperature, A <= 0")
    loss_agg: str = _f("token_mean", choices=["token_mean", "seq_mean", "seq_sum_norm"])
    loss_norm_len: Optional[int] = _f(
        None, lo=1, doc="seq_sum_norm (Dr.GRPO) constant; None = rollout.max_new_tokens"
    )
    entropy_coef: float = _f(0.0, lo=0.0, doc="entropy bonus weight in the policy loss")
    kl_coef: float = _f(0.0, lo=0.0)
    kl_estimator: str = _f("k3", choices=["k1", "k2", "k3"])
    kl_clamp: Optional[float] = _f(
        10.0,
        lo=0.0,
        lo_open=True,
        doc="k3 KL value clamped to +-kl_clamp as in verl (k1/k2 never); None = unclamped",
    )
    kl_in_reward: bool = False
    group_norm: bool = True
    group_std: bool = _f(True, doc="divide by the group std (False: Dr.GRPO mean-only)")
    leave_one_out: bool = False
    batch_norm: bool = False
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: Optional[float] = _f(None, lo=0.0, lo_open=True)
    overlong_buffer: int = _f(0, lo=0, doc="DAPO soft overlong penalty length (0 = off)")
    overlong_penalty: float = _f(1.0, lo=0.0)
    zero_reward_without_eos: bool = False
    dynamic_filter: bool = False
    gamma: float = _f(1.0, lo=0.0, hi=1.0)
    lam: float = _f(1.0, lo=0.0, hi=1.0)
    opd: str = _f(
        "off",
        choices=["off", "pure", "add"],
        doc="on-policy distillation: pure = "
        "advantage -opd_coef*(log pi - log pi_teacher) per token instead of the "
        "outcome advantage; add = the outcome advantage plus it (needs teacher.*)",
    )
    opd_coef: float = _f(1.0, lo=0.0, lo_open=True, doc="scale of the OPD advantage term")
    routing_replay: str = _f(
        "off",
        choices=["off", "r3"],
        doc="MoE routing replay: r3 = the "
        "rollout servers return each token's routed experts (started with "
        "--enable-return-routed-experts) and the actor's routers replay "
        "them (MoE models only)",
    )
    routing_replay_free_every: int = _f(
        10,
        lo=0,
        doc="with r3: every N steps one more proximal "
        "forward with free routing for moe/mismatch_free and "
        "moe/route_agreement (0 = never)",
    )


def check_policy_loss(alg) -> None:
    """``policy_loss`` against ``ratio_level`` (gspo <=> sequence) and ``dual_clip_c``."""
    want = "sequence" if alg.policy_loss == "gspo" else "token"
    if alg.ratio_level != want:
        raise ConfigError(
            f"algorithm.policy_loss={alg.policy_loss!r} contradicts "
            f"algorithm.ratio_level={alg.ratio_level!r}: policy_loss="
            f"{alg.policy_loss} uses the {want} ratio; set them consistently "
            "(gspo <=> sequence) or leave ratio_level out"
        )
    if alg.dual_clip_c is not None and alg.policy_loss in ("cispo", "sapo"):
        raise ConfigError(
            f"algorithm.dual_clip_c={alg.dual_clip_c!r}: has no meaning with "
            f"algorithm.policy_loss={alg.policy_loss!r} (no clipped surrogate); "
            "set algorithm.dual_clip_c=null"
        )


def check_routing_replay_model(cfg) -> None:
    """Raise one :class:`ConfigError` naming ``algorithm.routing_replay`` when it is on and
    ``model.path``'s config.json declares a dense model (no ``num_experts``): there are no
    routes to replay. Does nothing when the config cannot be read (the engine checks again)."""
    if cfg.algorithm.routing_replay == "off" or not cfg.model.path:
        return
    path = Path(cfg.model.path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(hf, dict) and not (hf.get("num_experts") or hf.get("num_local_experts")):
        raise ConfigError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay!r}: "
            f"model.path={cfg.model.path!r} is a dense model ({path}: model_type="
            f"{hf.get('model_type')!r}, no num_experts: no mixture-of-experts layers); "
            "routing replay needs a "
            "mixture-of-experts model (set algorithm.routing_replay=off)"
        )

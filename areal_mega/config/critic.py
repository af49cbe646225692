"""The ``critic`` section of the experiment config (the value model of GAE) and its checks: the
estimator that uses it, its learning rates and warm-up, and the model directory it starts from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areal_mega.checkpoint.value_model import hf_num_labels, is_sequence_classification
from areal_mega.common.errors import ConfigError
from areal_mega.config.schema import _f

__all__ = ["CriticConfig", "check_critic", "check_critic_model"]


@dataclass
class CriticConfig:
    enabled: bool = _f(False, doc="build a value model (needed by algorithm.adv_estimator=gae)")
    path: str = _f(
        "",
        doc="HF directory of the critic's initial weights (an LM: fresh value "
        "head; a one-label *ForSequenceClassification: its score head); defaults "
        "to model.path",
    )
    lr: float = _f(1e-5, lo=0.0)
    min_lr: float = _f(0.0, lo=0.0)
    lr_warmup_steps: int = _f(0, lo=0, doc="LR warm-up of the critic's optimizer")
    lr_schedule: str = _f("constant", choices=["constant", "cosine", "linear"])
    lr_decay_steps: int = _f(0, lo=0, doc="0 = total_steps")
    clip_grad: float = _f(1.0, lo=0.0)
    value_loss_coef: float = _f(
        0.5, lo=0.0, lo_open=True, doc="scale of the value loss (critic has its own optimizer)"
    )
    value_clip: Optional[float] = _f(
        0.2, lo=0.0, lo_open=True, doc="clip V - V_old to +-value_clip; None = unclipped"
    )
    warmup_steps: int = _f(0, lo=0, doc="first RL steps in which only the critic trains")
    ppo_n_minibatches: int = _f(1, lo=1)
    bootstrap_truncated: bool = _f(
        False,
        doc="bootstrap GAE with the value after the last "
        "token of samples cut by max_new_tokens (finish=length)",
    )


def check_critic(cfg, gae: bool) -> None:
    """The critic section against the estimator that uses it."""
    c = cfg.critic
    if cfg.mode != "rl":
        return
    if gae and not c.enabled:
        raise ConfigError(
            "algorithm.adv_estimator='gae': needs a value model; set "
            "critic.enabled=true (or use adv_estimator=grpo or reinforce)"
        )
    if c.enabled and not gae:
        raise ConfigError(
            f"critic.enabled=true: only algorithm.adv_estimator='gae' uses the "
            f"critic, not {cfg.algorithm.adv_estimator!r}; set "
            "critic.enabled=false or algorithm.adv_estimator=gae"
        )
    if c.min_lr > c.lr:
        raise ConfigError(f"critic.min_lr={c.min_lr!r}: must be <= critic.lr ({c.lr})")
    if c.warmup_steps >= cfg.total_steps and c.enabled:
        raise ConfigError(
            f"critic.warmup_steps={c.warmup_steps}: must be < total_steps="
            f"{cfg.total_steps}, or the actor never trains"
        )


def check_critic_model(cfg) -> None:
    """Raise one :class:`ConfigError` when ``critic.path`` (RL with a critic) is not an HF
    model directory (no ``config.json`` object there) or is a sequence-classification model
    with other than one label (a value model scores each token with one number)."""
    c = cfg.critic
    if cfg.mode != "rl" or not c.enabled or not c.path:
        return
    path = Path(c.path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"critic.path={c.path!r}: not an HF model directory ({path}: {type(e).__name__}: {e})"
        ) from None
    if not isinstance(hf, dict) or "model_type" not in hf and "architectures" not in hf:
        raise ConfigError(
            f"critic.path={c.path!r}: {path} is not a model config (no model_type / architectures)"
        )
    if is_sequence_classification(hf.get("architectures")) and hf_num_labels(hf) != 1:
        raise ConfigError(
            f"critic.path={c.path!r}: {hf['architectures'][0]} with num_labels="
            f"{hf_num_labels(hf)} ({path}: id2label={hf.get('id2label')}); the "
            "critic needs a one-label score head (num_labels=1)"
        )

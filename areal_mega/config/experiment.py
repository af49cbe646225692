"""Typed experiment configuration: :class:`ExperimentConfig`, one dataclass per section, loaded
from a recipe YAML and overridden by dotlist arguments (``actor.lr=1e-6
allocation=sglang:d2+megatron:t2p2``), then checked.

Every problem is reported as one :class:`ConfigError` naming the dotted key, the value and what
is allowed. Ranges and choices are declared next to each field (``_f(default, lo=, hi=,
choices=)``, :mod:`areal_mega.config.schema`), so the schema reads as documentation; the rules
of one section sit beside it, and :func:`validate` runs them with the rules across sections.
:func:`check_against_model` checks the config against the model directory, where one exists: a
rollout whose prompt and completion cannot fit the model's context would only fail later,
request by request, on the rollout servers. No torch, no megatron: the launcher, the trainer
and the demo call it first thing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from areal_mega.common.errors import ConfigError
from areal_mega.config.algorithm import (
    AlgorithmConfig,
    check_policy_loss,
    check_routing_replay_model,
)
from areal_mega.config.critic import CriticConfig, check_critic, check_critic_model
from areal_mega.config.logging import LoggingConfig
from areal_mega.config.lora import LoraConfig, check_lora, check_lora_model
from areal_mega.config.presets import resolve_algorithm
from areal_mega.config.rollout import RolloutConfig, check_rollout
from areal_mega.config.schema import _build, _f, _merge, parse_overrides
from areal_mega.config.sections import (
    ActorConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DataplaneConfig,
    EvalConfig,
    ModelConfig,
    ModelHParams,
    OptimizerConfig,
    RefConfig,
    SchedulerConfig,
)
from areal_mega.config.teacher import TeacherConfig, check_opd, check_teacher_model
from areal_mega.config.vllm import check_vllm
from areal_mega.data.sources import check_sources
from areal_mega.parallel.allocation import AllocationError, parse_allocation
from areal_mega.security import api_key_from_env, check_remote_secret
from areal_mega.tracking.base import check_trackers

__all__ = [
    "ExperimentConfig",
    "check_against_model",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "model_context",
    "validate",
]


# advantage estimators that compare the samples of one prompt (areal_mega.algo.estimators)
GROUP_ESTIMATORS = ("rloo", "opo", "grpo_passk", "reinforce_plus_plus_baseline")


@dataclass
class ExperimentConfig:
    name: str = "areal-mega"
    seed: int = _f(1, lo=0)
    total_steps: int = _f(100, lo=1)
    mode: str = _f("rl", choices=["rl", "sft"])
    recover: str = _f("off", choices=["off", "auto"])
    allocation: str = _f(
        "local:d1+megatron:d1",
        doc="<rollout>:<dims>+<trainer>:<dims>, e.g. sglang:d4t2+megatron:t2p2",
    )
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    dataplane: DataplaneConfig = field(default_factory=DataplaneConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model_hparams: Optional[ModelHParams] = _f(
        None, doc="published architecture numbers for the --dry-run memory estimate"
    )


def config_from_dict(data: dict) -> ExperimentConfig:
    """Build and validate an :class:`ExperimentConfig` from a nested dict, after applying
    ``algorithm.preset`` (explicit keys win) and pairing ``policy_loss`` / ``ratio_level``
    (:func:`~areal_mega.config.presets.resolve_algorithm`)."""
    cfg = _build(ExperimentConfig, resolve_algorithm(data or {}))
    validate(cfg)
    return cfg


def load_config(
    path: Optional[str | Path] = None, overrides: Optional[list[str]] = None
) -> ExperimentConfig:
    """Load a recipe YAML (optional) and apply dotlist overrides; ``rollout.api_key`` left
    unset comes from the environment (:func:`areal_mega.security.api_key_from_env`). Raises
    :class:`ConfigError`."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r}: not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r}: invalid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping")
    data = _merge(data, parse_overrides(overrides or []))
    rollout = data.get("rollout")
    if not (isinstance(rollout, dict) and rollout.get("api_key")):
        key = api_key_from_env()  # e.g. the Slurm steps: the key never in argv
        if key:
            data = _merge(data, {"rollout": {"api_key": key}})
    return config_from_dict(data)


def config_to_dict(cfg) -> dict:
    """The config as a nested dict of plain values."""
    return dataclasses.asdict(cfg)


def validate(cfg) -> None:
    """The rules of an :class:`ExperimentConfig` that no single field can express: each
    section's own (written beside the section) and those across sections."""
    try:
        parse_allocation(cfg.allocation)
    except AllocationError as e:
        raise ConfigError(f"allocation={cfg.allocation!r}: {e}") from None
    check_remote_secret(cfg)
    check_trackers(cfg.logging.trackers)
    try:
        check_sources(cfg.data)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    im = cfg.data.images
    if im.min_pixels and im.max_pixels and im.min_pixels > im.max_pixels:
        raise ConfigError(
            f"data.images.min_pixels={im.min_pixels}: must be <= data.images.max_pixels "
            f"({im.max_pixels})"
        )
    if cfg.optimizer.min_lr > cfg.optimizer.lr:
        raise ConfigError(
            f"optimizer.min_lr={cfg.optimizer.min_lr!r}: must be <= optimizer.lr "
            f"({cfg.optimizer.lr})"
        )
    gae = cfg.algorithm.adv_estimator == "gae"
    if cfg.mode == "rl" and cfg.algorithm.kl_in_reward and cfg.algorithm.kl_coef > 0 and not gae:
        raise ConfigError(
            "algorithm.kl_in_reward=true: with adv_estimator="
            f"{cfg.algorithm.adv_estimator!r} the trainer computes advantages "
            "before the reference forward, so the KL penalty is a loss term "
            "only; set algorithm.kl_in_reward=false, or use adv_estimator=gae "
            "with critic.enabled=true (GAE runs after the reference forward)"
        )
    check_critic(cfg, gae)
    check_lora(cfg)
    check_vllm(cfg)
    check_opd(cfg)
    check_policy_loss(cfg.algorithm)
    if cfg.algorithm.kl_coef > 0 and not cfg.ref.enabled:
        raise ConfigError(f"algorithm.kl_coef={cfg.algorithm.kl_coef!r}: needs ref.enabled=true")
    outcome = cfg.algorithm.opd != "pure"  # pure OPD discards the outcome advantage
    if (
        cfg.algorithm.adv_estimator == "grpo"
        and cfg.mode == "rl"
        and cfg.rollout.n_samples < 2
        and cfg.algorithm.group_norm
        and outcome
    ):
        raise ConfigError(
            f"rollout.n_samples={cfg.rollout.n_samples}: GRPO group normalisation "
            "needs at least 2 samples per prompt"
        )
    if (
        cfg.algorithm.adv_estimator in GROUP_ESTIMATORS
        and cfg.mode == "rl"
        and cfg.rollout.n_samples < 2
        and outcome
    ):
        raise ConfigError(
            f"rollout.n_samples={cfg.rollout.n_samples}: adv_estimator="
            f"{cfg.algorithm.adv_estimator} compares the samples of a prompt and "
            "needs at least 2 per prompt (a group of one gets advantage 0)"
        )
    if cfg.eval.every_steps and not cfg.eval.data:
        raise ConfigError(
            f"eval.every_steps={cfg.eval.every_steps}: eval.data is empty; name "
            "the evaluation prompt files or set eval.every_steps=0"
        )
    if cfg.algorithm.routing_replay != "off" and cfg.mode != "rl":
        raise ConfigError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay!r}: replays "
            f"rollout routes, so it needs mode=rl, not mode={cfg.mode!r}"
        )
    if cfg.eval.every_steps and cfg.mode != "rl":
        raise ConfigError(
            f"eval.every_steps={cfg.eval.every_steps}: evaluation during "
            f"training runs on the rollout servers (mode=rl), not mode="
            f"{cfg.mode!r}; use python -m areal_mega.eval on the checkpoint"
        )
    check_rollout(cfg.rollout)


def model_context(model_path: str) -> Optional[tuple]:
    """``(max_position_embeddings, config.json path)`` of an HF model directory, or None when
    the directory has no config.json or it declares no context length (then nothing can be
    checked). Raises :class:`ConfigError` naming the file when it is not a JSON object."""
    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={model_path!r}: {path} is unreadable: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.path={model_path!r}: {path} is not a JSON object")
    for section in (hf, hf.get("text_config")):  # multimodal configs nest the text model
        n = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, path
    return None


def check_against_model(cfg) -> None:
    """Raise one :class:`ConfigError` naming the keys when, in RL mode, the longest prompt the
    data may hold plus the generation budget (``data.max_prompt_len +
    rollout.max_new_tokens``) exceeds the context of ``model.path`` (``max_position_embeddings``
    of its ``config.json``). Does nothing when the model's context is unknown. First runs the
    sections' own checks against their model directories (critic, teacher, LoRA, and in RL
    mode routing replay)."""
    check_critic_model(cfg)
    check_teacher_model(cfg)
    check_lora_model(cfg)
    if cfg.mode != "rl":
        return
    check_routing_replay_model(cfg)
    known = model_context(cfg.model.path)
    if known is None:
        return
    context, path = known
    need = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if need > context:
        raise ConfigError(
            f"data.max_prompt_len={cfg.data.max_prompt_len} + rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} = {need} tokens exceeds the model's context of "
            f"{context} (max_position_embeddings in {path}): every such request would be "
            "rejected by the rollout servers; lower data.max_prompt_len or "
            "rollout.max_new_tokens"
        )

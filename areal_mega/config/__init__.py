"""The experiment configuration: one typed dataclass per section, loaded from a recipe YAML and
dotlist overrides, each problem one :class:`ConfigError` naming the dotted key.

Readers import from here (``from areal_mega.config import ExperimentConfig, load_config``). The
package holds the schema machinery (:mod:`.schema`: field ranges, coercion, overrides), the
root config with loading and the rules across sections (:mod:`.experiment`), the sections whose
rules are their fields' ranges (:mod:`.sections`), the sections with rules of their own, each
beside its checks (:mod:`.algorithm`, :mod:`.critic`, :mod:`.teacher`, :mod:`.rollout`,
:mod:`.vllm`, :mod:`.lora`, :mod:`.logging`), and the algorithm presets (:mod:`.presets`).
:class:`ConfigError` itself lives in :mod:`areal_mega.common.errors`, so the low layers raise it
without importing the config.
"""

from __future__ import annotations

from areal_mega.common.errors import ConfigError
from areal_mega.config.algorithm import AlgorithmConfig
from areal_mega.config.critic import CriticConfig
from areal_mega.config.experiment import (
    ExperimentConfig,
    check_against_model,
    config_from_dict,
    config_to_dict,
    load_config,
    model_context,
    validate,
)
from areal_mega.config.logging import LoggingConfig, MlflowConfig, WandbConfig
from areal_mega.config.lora import LoraConfig
from areal_mega.config.presets import PRESETS
from areal_mega.config.rollout import OnlineConfig, RolloutConfig
from areal_mega.config.schema import parse_overrides
from areal_mega.config.sections import (
    ActorConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DataImagesConfig,
    DataplaneConfig,
    DataSourceConfig,
    EvalConfig,
    ModelConfig,
    ModelHParams,
    OptimizerConfig,
    RefConfig,
    SchedulerConfig,
)
from areal_mega.config.teacher import TeacherConfig, check_same_tokenizer
from areal_mega.config.vllm import MANAGED_VLLM_FLAGS, VllmConfig

__all__ = [
    # loading and checking
    "ConfigError",
    "ExperimentConfig",
    "check_against_model",
    "check_same_tokenizer",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "model_context",
    "parse_overrides",
    "validate",
    # the sections
    "ActorConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CriticConfig",
    "DataConfig",
    "DataImagesConfig",
    "DataSourceConfig",
    "DataplaneConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "MlflowConfig",
    "ModelConfig",
    "ModelHParams",
    "OnlineConfig",
    "OptimizerConfig",
    "RefConfig",
    "RolloutConfig",
    "SchedulerConfig",
    "TeacherConfig",
    "VllmConfig",
    "WandbConfig",
    # tables
    "MANAGED_VLLM_FLAGS",
    "PRESETS",
]

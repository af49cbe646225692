"""The ``logging`` section of the experiment config: run directory, TensorBoard, progress bar,
plot, experiment trackers (W&B, MLflow) and the sample log. The tracker names are checked by
:func:`areal_mega.tracking.base.check_trackers`, beside the trackers."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mega.config.schema import _f


@dataclass
class WandbConfig:
    """Weights & Biases (``logging.trackers: [wandb]``, ``pip install -e .[wandb]``)."""

    project: str = _f("areal-mega", doc="W&B project")
    entity: str = _f("", doc="W&B team or user; empty = the key's default entity")
    name: str = _f("", doc="run name; empty = the experiment's name")
    tags: list = _f(factory=list, doc="run tags")
    mode: str = _f(
        "auto",
        choices=["auto", "online", "offline"],
        doc="auto: online with an API key and a reachable server, else offline "
        "(said once); offline runs upload later with `wandb sync`",
    )


@dataclass
class MlflowConfig:
    """MLflow (``logging.trackers: [mlflow]``, ``pip install -e .[mlflow]``)."""

    tracking_uri: str = _f("", doc="empty = a local file store, file:<run_dir>/mlruns")
    experiment: str = _f("", doc="experiment name; empty = the experiment's name")
    run_name: str = _f("", doc="empty = the experiment's name")


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    tensorboard: bool = True
    progress_bar: bool = True
    plot: bool = True
    trackers: list = _f(
        factory=list,
        doc="experiment trackers fed from trainer rank 0: "
        "tensorboard (= tensorboard: true), wandb, mlflow (pip install -e "
        ".[wandb] / .[mlflow])",
    )
    log_samples_every: int = _f(
        10,
        lo=0,
        doc="steps between sample groups written to "
        "<run_dir>/samples.jsonl and the trackers; 0 = off",
    )
    log_samples_groups: int = _f(2, lo=1, doc="prompt groups per sample log")
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

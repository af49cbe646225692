"""What every tracker shares: the names, the config check, the per-tracker state file and
the row filtering (no tracker package is imported here)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from areal_mega.common.errors import ConfigError
from areal_mega.common.files import atomic_write

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The names ``logging.trackers`` accepts."""
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> (module, extra) to install


def check_trackers(trackers: list) -> None:
    """``logging.trackers``: known names only, and each chosen extra installed; one
    :class:`ConfigError` naming the key, the bad name and the ``pip install`` that fixes it."""
    for name in trackers:
        if name not in TRACKERS:
            raise ConfigError(
                f"logging.trackers: unknown tracker {name!r}; choose from {list(TRACKERS)}"
            )
        module = EXTRAS.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"logging.trackers: {name!r} is chosen but the {module!r} package "
                f"is not installed: pip install -e .[{name}]"
            )


def flat_params(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = v
    return out


def finite_scalars(row: dict) -> dict:
    """The finite numbers of a metrics row, without ``step`` and ``time``."""
    return {
        k: v
        for k, v in row.items()
        if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v)
    }


class TrackerState:
    """``<run_dir>/<name>_run.json``: a tracker's run id and the last step it logged."""

    def __init__(self, run_dir: Path, name: str):
        self.path = Path(run_dir) / f"{name}_run.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    @property
    def last_step(self) -> int:
        return int(self.data.get("last_step", -1))

    def save(self, **fields) -> None:
        self.data.update(fields)
        atomic_write(self.path, json.dumps(self.data), durable=True)

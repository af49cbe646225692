"""MLflow (``logging.trackers: [mlflow]``; ``pip install -e .[mlflow]``).

``logging.mlflow.tracking_uri`` (empty: a local file store, ``file:<run_dir>/mlruns``; a
``sqlite:`` or ``http(s):`` URI works as MLflow supports it). Parameters: the redacted resolved
config, flattened (``rollout.batch_size``), once per run; metrics: every finite scalar of each
row at its step; samples: a JSONL artifact per logged step (``samples/step_<N>.jsonl``). The
run id is kept in ``<run_dir>/mlflow_run.json``, so a resumed run continues the same MLflow run.

In a file store a metric is a file named like the metric, so ``ppo_kl`` and
``ppo_kl/first_minibatch`` cannot both exist: there every ``/`` of a metric name becomes ``.``
(``reward.mean``); other stores keep the names of ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from areal_mega.security import redact_text
from areal_mega.tracking.base import TrackerState, finite_scalars, flat_params

MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value
BATCH = 100  # MLflow's limit on parameters per log_batch


class MlflowTracker:
    """One MLflow run per areal-mega run (see the module doc)."""

    name = "mlflow"

    def __init__(self, cfg, params: dict, run_dir: Path, resumed: bool):
        """Start or (``resumed``) continue the run; ``params``: the redacted config."""
        m = cfg.logging.mlflow
        self.state = TrackerState(run_dir, self.name)
        if not resumed:
            self.state.data = {}
        uri = m.tracking_uri or (Path(run_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store only on request; it needs no server or database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        run_id = self.state.data.get("run_id")
        shown = redact_text(uri)  # the state file keeps no password of the URI
        continued = bool(run_id and self.state.data.get("tracking_uri") in (uri, shown))
        if continued:
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = m.experiment or cfg.name
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id, run_name=m.run_name or cfg.name).info.run_id
            flat = [
                Param(k, (v if isinstance(v, str) else json.dumps(v))[:MAX_PARAM_CHARS])
                for k, v in sorted(flat_params(params).items())
            ]
            for i in range(0, len(flat), BATCH):
                self.client.log_batch(run_id, params=flat[i : i + BATCH])
        self.run_id = run_id
        self.key = _file_store_key if uri.startswith("file:") else _key
        last = max(self.state.last_step, self._pending_step_logged() if continued else -1)
        self.state.save(run_id=run_id, tracking_uri=shown, last_step=last, pending=None)

    def _pending_step_logged(self) -> int:
        """A step whose log a crash interrupted before its state was saved: its step when its
        last metric reached the store (the whole step is there, it is not logged again), else
        -1 (it is logged again; only a crash inside one batch can repeat its first points)."""
        pending = self.state.data.get("pending")
        if not pending or not self.state.data.get("run_id"):
            return -1
        history = self.client.get_metric_history(self.state.data["run_id"], pending["key"])
        return int(pending["step"]) if any(m.step == pending["step"] for m in history) else -1

    def log(self, step: int, row: dict) -> None:
        """Every finite scalar of ``row`` at ``step``; then remember ``step``. The step and
        its last metric's name are saved first, so a resumed run can tell whether a crash
        came before or after they reached the store."""
        ts = int(row.get("time", time.time()) * 1000)
        metrics = [
            Metric(self.key(k), float(v), ts, int(step)) for k, v in finite_scalars(row).items()
        ]
        if metrics:
            self.state.save(pending={"step": int(step), "key": metrics[-1].key})
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self.state.save(last_step=int(step), pending=None)

    def log_samples(self, step: int, rows: list, name: str = "samples") -> None:
        """``rows`` as the artifact ``<name>/step_<step>.jsonl``."""
        text = "".join(json.dumps(r) + "\n" for r in rows)
        self.client.log_text(self.run_id, text, f"{name}/step_{int(step):07d}.jsonl")

    def close(self) -> None:
        """Mark the run finished (a resumed run sets it running again)."""
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


def _key(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . / space``)."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def _file_store_key(key: str) -> str:
    """A metric name for a file store: ``/`` (a directory there) becomes ``.``."""
    return _key(key).replace("/", ".")

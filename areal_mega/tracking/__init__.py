"""What a run logs, from trainer rank 0: ``metrics.jsonl`` first, then TensorBoard, Weights &
Biases and MLflow (``logging.trackers``), plus the sample log (``samples.jsonl``).

- :mod:`.metrics` -- ``metrics.jsonl`` (one fsync'd line a step, rewritten on resume), the
  TensorBoard scalars, the progress bar and the reward plot;
- :mod:`.base` -- what every tracker shares: the names, the config check, the per-run state
  file, the row filtering;
- :mod:`.wandb_tracker`, :mod:`.mlflow_tracker` -- one optional tracker each;
- :mod:`.samples` -- ``samples.jsonl``: a few prompt groups every
  ``logging.log_samples_every`` steps, decoded;
- here: :class:`RunLog`, all of them behind one ``log``.

    log = RunLog(cfg, run_dir, resume_step=None)      # rank 0 only
    log.log_samples(step, trajs, advantages)          # every logging.log_samples_every steps
    log.log(step, {"reward/mean": 0.4, ...})          # metrics.jsonl, then every tracker
    log.close()

W&B and MLflow are optional extras (``pip install -e .[wandb]`` / ``.[mlflow]``), imported only
when chosen. Each keeps its run's id and the last step it logged in the run directory
(``wandb_run.json`` / ``mlflow_run.json``), so ``recover=auto`` continues the same tracker run
and a step the resumed trainer redoes (after the checkpoint, before the crash) is not logged
twice: a tracker takes only steps above its last one. ``metrics.jsonl`` is rewritten on resume
and always holds the redone values. A tracker that lost steps up to the checkpoint (W&B offline
writes its file in blocks: a killed trainer loses the tail) gets them again from
``metrics.jsonl`` and ``samples.jsonl``, so no step is missing either. Parameters are the
resolved config with every secret redacted (:func:`areal_mega.security.redact_secrets`: by key
name, URL password and value); the config's secrets are registered, so log records and sample
rows hide them too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from areal_mega.security import install_log_redaction, redact_secrets
from areal_mega.tracking.base import TRACKERS, check_trackers
from areal_mega.tracking.metrics import MetricsLogger, read_metrics
from areal_mega.tracking.samples import SampleLog

__all__ = ["RunLog", "TRACKERS", "check_trackers"]


class RunLog:
    """Rank 0's logs of one run: :class:`~areal_mega.tracking.metrics.MetricsLogger`, the
    chosen trackers and the :class:`~areal_mega.tracking.samples.SampleLog`.

    ``cfg``: the experiment config; ``resume_step``: the checkpoint step a resumed run
    continues from (None: a fresh run, whose tracker state files are ignored)."""

    def __init__(self, cfg, run_dir: str | Path, resume_step: Optional[int] = None):
        check_trackers(cfg.logging.trackers)
        self.run_dir = Path(run_dir)
        lg = cfg.logging
        tensorboard = lg.tensorboard or "tensorboard" in lg.trackers
        self.metrics = MetricsLogger(self.run_dir, tensorboard=tensorboard, resume_step=resume_step)
        self.samples = SampleLog(
            self.run_dir,
            cfg.model.path,
            every=lg.log_samples_every,
            n_groups=lg.log_samples_groups,
            resume_step=resume_step,
        )
        self.trackers = []
        resumed = resume_step is not None
        tree = dataclasses.asdict(cfg)
        install_log_redaction(tree)  # its secrets hidden in logs and samples from now on
        params = redact_secrets(tree)  # no secret reaches a tracker
        try:
            if "wandb" in lg.trackers:
                from areal_mega.tracking.wandb_tracker import WandbTracker

                self.trackers.append(WandbTracker(cfg, params, self.run_dir, resumed))
            if "mlflow" in lg.trackers:
                from areal_mega.tracking.mlflow_tracker import MlflowTracker

                self.trackers.append(MlflowTracker(cfg, params, self.run_dir, resumed))
        except BaseException:
            self.close()
            raise
        if resumed:
            self._replay(resume_step)

    def _replay(self, resume_step: int) -> None:
        """A tracker that lost steps up to the checkpoint (a killed W&B process's unflushed
        records) gets them again from ``metrics.jsonl`` and ``samples.jsonl``."""
        for t in self.trackers:
            held = t.state.last_step
            if held >= resume_step:
                continue
            rows = [r for r in read_metrics(self.metrics.path) if held < r["step"] <= resume_step]
            samples = [
                r for r in read_metrics(self.samples.path) if held < r["step"] <= resume_step
            ]
            for row in rows:
                mine = [r for r in samples if r["step"] == row["step"]]
                for kind, name in (("train", "samples"), ("eval", "eval_samples")):
                    if any(r["kind"] == kind for r in mine):
                        t.log_samples(
                            row["step"], [r for r in mine if r["kind"] == kind], name=name
                        )
                t.log(row["step"], row)

    def log(self, step: int, scalars: dict) -> dict:
        """Append the row of ``step`` to ``metrics.jsonl`` (durable), then hand it to every
        tracker that has not logged ``step`` yet. Returns the row."""
        row = self.metrics.log(step, scalars)
        for t in self.trackers:
            if step > t.state.last_step:
                t.log(step, row)
        return row

    def log_samples(self, step: int, trajs: list, advantages: dict) -> None:
        """When ``step`` is due (``logging.log_samples_every``): write the first
        ``logging.log_samples_groups`` prompt groups of ``trajs`` to ``samples.jsonl`` and
        to every tracker (a W&B Table, an MLflow artifact). ``advantages``: sample id ->
        mean advantage over its trained tokens."""
        rows = self.samples.write(step, trajs, advantages)
        for t in self.trackers:
            if rows and step > t.state.last_step:
                t.log_samples(step, rows)

    def log_eval_samples(self, step: int, rows: list) -> None:
        """The evaluation pass's completions (``kind: eval`` rows) to ``samples.jsonl`` and
        the trackers."""
        rows = self.samples.write_rows(step, rows, kind="eval")
        for t in self.trackers:
            if rows and step > t.state.last_step:
                t.log_samples(step, rows, name="eval_samples")

    def close(self) -> None:
        """Finish every tracker run and close the files."""
        for t in self.trackers:
            t.close()
        self.trackers = []
        self.metrics.close()

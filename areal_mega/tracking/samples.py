"""``<run_dir>/samples.jsonl``: a few prompt groups every ``logging.log_samples_every`` steps,
decoded by the model's tokenizer, one JSON object per sample:

    {"step", "kind": "train", "group_id", "sample_id", "prompt", "completion", "reward",
     "advantage", "response_len", "finish_reason", "version_min", "version_max"}

(``kind: eval`` rows hold the evaluation pass's completions). Appended and fsync'd like
``metrics.jsonl``, and cut back to the checkpoint's step on resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from areal_mega.data.dataset import load_tokenizer
from areal_mega.security import redact_text
from areal_mega.tracking.metrics import truncate_metrics

SAMPLES_FILE = "samples.jsonl"
COLUMNS = (
    "kind",
    "group_id",
    "sample_id",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "response_len",
    "finish_reason",
    "version_min",
    "version_max",
)
"""The table columns the trackers get (each row also has ``step``)."""


def sample_row(traj, advantage: Optional[float], decode) -> dict:
    """One trajectory as a samples row (``decode``: token ids -> text)."""
    ids = np.asarray(traj.input_ids)
    gen = np.asarray(traj.versions)[traj.prompt_len :]
    gen = gen[gen >= 0]
    return {
        "kind": "train",
        "group_id": str(traj.group_id),
        "sample_id": str(traj.sample_id),
        "prompt": decode(ids[: traj.prompt_len].tolist()),
        "completion": decode(ids[traj.prompt_len :].tolist()),
        "reward": float(traj.total_reward),
        "advantage": None if advantage is None else float(advantage),
        "response_len": int(len(ids) - traj.prompt_len),
        "finish_reason": str(traj.finish_reason),
        "version_min": int(gen.min()) if len(gen) else -1,
        "version_max": int(gen.max()) if len(gen) else -1,
    }


class SampleLog:
    """Writes the due steps' sample groups; ``every=0`` turns it off. The tokenizer of
    ``model_path`` is loaded on the first due step."""

    def __init__(
        self,
        run_dir: str | Path,
        model_path: str,
        *,
        every: int,
        n_groups: int,
        resume_step: Optional[int] = None,
    ):
        self.path = Path(run_dir) / SAMPLES_FILE
        self.model_path, self.every, self.n_groups = model_path, every, n_groups
        self._tok = None
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)

    def due(self, step: int) -> bool:
        """Whether ``step`` logs samples."""
        return self.every > 0 and step % self.every == 0

    def decode(self, ids: list) -> str:
        """Token ids -> text with the model's tokenizer (special tokens kept)."""
        if self._tok is None:
            self._tok = load_tokenizer(self.model_path)
        return self._tok.decode(ids, skip_special_tokens=False)

    def write(self, step: int, trajs: list, advantages: dict) -> list:
        """The rows of the first ``n_groups`` groups of ``trajs`` when ``step`` is due (else
        ``[]``), appended to ``samples.jsonl``."""
        if not self.due(step) or not trajs:
            return []
        groups: list = []
        for t in trajs:
            if t.group_id not in groups:
                if len(groups) == self.n_groups:
                    continue
                groups.append(t.group_id)
        rows = [
            sample_row(t, advantages.get(t.sample_id), self.decode)
            for t in trajs
            if t.group_id in groups
        ]
        return self.write_rows(step, rows, kind="train")

    def write_rows(self, step: int, rows: list, kind: str) -> list:
        """Append ``rows`` (stamped with ``step`` and ``kind``, every known secret in their
        text hidden: :func:`~areal_mega.security.redact_text`) durably; returns them."""
        rows = [
            {
                "step": int(step),
                **{k: redact_text(v) if isinstance(v, str) else v for k, v in r.items()},
                "kind": kind,
            }
            for r in rows
        ]
        if not rows:
            return rows
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        return rows

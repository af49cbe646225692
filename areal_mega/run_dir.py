"""The run directory: its layout, and the questions every process of a run asks of it.

The trainer, the rollout worker and the launcher all find their files and sockets here, so
the layout is written down once (no torch, no megatron: any process may import it)::

    <run_dir>/config.yaml            the launcher's resolved config (what every process reads)
    <run_dir>/config.resolved.json   the trainer's view of it (both 0600 when they hold a secret)
    <run_dir>/sglang-api-key.yaml    0600, rollout.api_key for SGLang's --config (not on argv)
    <run_dir>/checkpoints/iter_NNNNNNN/   complete once areal_meta.json (written last) exists
    <run_dir>/checkpoints/latest     name of the newest complete checkpoint
    <run_dir>/journal/NNNNNNNN.journal    accepted trajectories not yet covered by a checkpoint
    <run_dir>/init_mcore[_ref]/      the HF model converted once at the start of the run
    <run_dir>/rollout_state.json     the rollout worker's prompt position
    <run_dir>/metrics.jsonl, trained.jsonl, tensorboard/, logs/
    ipc://<run_dir>/trajectories.sock, ipc://<run_dir>/control.sock   default endpoints

``checkpoint.dir`` and the ``dataplane`` endpoints override the defaults.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

log = logging.getLogger(__name__)

META_NAME = "areal_meta.json"
"""Written last into a checkpoint directory: its presence marks the checkpoint complete."""
ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    """``iter_0000042``: the directory name of the checkpoint saved after step ``iteration``."""
    return f"iter_{int(iteration):07d}"


def checkpoint_iteration(ckpt) -> int:
    """The step a checkpoint directory ``iter_NNNNNNN`` was saved after."""
    m = ITER_RE.match(Path(ckpt).name)
    if m is None:
        raise ValueError(f"{ckpt}: not a checkpoint directory name (iter_NNNNNNN)")
    return int(m.group(1))


def complete_checkpoints(root) -> List[Path]:
    """Every complete ``iter_*`` checkpoint under ``root``, oldest first."""
    root = Path(root)
    out = [p for p in (root.iterdir() if root.is_dir() else [])
           if p.is_dir() and ITER_RE.match(p.name) and (p / META_NAME).is_file()]
    return sorted(out, key=lambda p: int(ITER_RE.match(p.name).group(1)))


def find_latest(root) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (the ``latest`` pointer if it names a
    complete one, else the highest complete ``iter_*``), or None when there is none."""
    root = Path(root)
    ptr = root / "latest"
    if ptr.is_file():
        cand = root / ptr.read_text().strip()
        if ITER_RE.match(cand.name) and (cand / META_NAME).is_file():
            return cand
        log.warning("%s names %s, which is not a complete checkpoint; scanning", ptr, cand)
    done = complete_checkpoints(root)
    return done[-1] if done else None


def checkpoint_meta(ckpt) -> dict:
    """The parsed ``areal_meta.json`` of a checkpoint directory (no shard checks: see
    :func:`areal_mega.checkpoint.dist_ckpt.verify_checkpoint` for those)."""
    path = Path(ckpt) / META_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable checkpoint metadata ({e})") from None


@dataclass(frozen=True)
class RunDir:
    """Paths and endpoints of one run, derived from the config in one place."""

    root: Path
    checkpoint_root: Path
    data_endpoint: str
    control_endpoint: str

    @classmethod
    def from_config(cls, cfg) -> "RunDir":
        """The run directory of ``cfg`` (an :class:`~areal_mega.config.ExperimentConfig`)."""
        root = Path(cfg.logging.run_dir).resolve()
        return cls(root=root,
                   checkpoint_root=Path(cfg.checkpoint.dir).resolve() if cfg.checkpoint.dir
                   else root / "checkpoints",
                   data_endpoint=cfg.dataplane.endpoint or f"ipc://{root}/trajectories.sock",
                   control_endpoint=(cfg.dataplane.control_endpoint
                                     or f"ipc://{root}/control.sock"))

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def resolved_config_file(self) -> Path:
        return self.root / "config.resolved.json"

    @property
    def sglang_key_file(self) -> Path:
        return self.root / "sglang-api-key.yaml"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def rollout_state(self) -> Path:
        return self.root / "rollout_state.json"

    def init_checkpoint(self, reference: bool = False) -> Path:
        """Where the initial HF weights are converted to (the reference model's own, if any)."""
        return self.root / ("init_mcore_ref" if reference else "init_mcore")

    def latest_checkpoint(self) -> Optional[Path]:
        """The checkpoint a ``recover=auto`` trainer resumes from, or None."""
        return find_latest(self.checkpoint_root)

    def accepted_samples(self, ckpt: Optional[Path]) -> int:
        """Samples the trainer has accepted in this run's lineage: those counted by checkpoint
        ``ckpt`` (the one it resumes from; None for a fresh start) plus those in the journal
        segments written since."""
        from areal_mega.dataplane.journal import TrajectoryJournal

        before = 0
        if ckpt is not None:
            before = int(checkpoint_meta(ckpt).get("extra", {}).get("accepted_samples", 0))
        return before + sum(1 for _ in TrajectoryJournal.replay(self.journal))

"""Trainer-side intake of trajectories: ZMQ receiver -> write-ahead journal -> buffer (rank 0).

Nothing accepted is lost on a crash:
* every trajectory is appended to the journal ``<run_dir>/journal/``
  (:class:`~areal_mega.dataplane.journal.TrajectoryJournal`: checksummed records, fsync'd)
  before it enters the :class:`~areal_mega.dataplane.buffer.TrajectoryBuffer`;
* each checkpoint stores the buffer (pending samples + the ids already trained on) and starts
  a new journal segment, whose number it records (``journal_from``); a segment is deleted only
  once no kept checkpoint needs it (:func:`~areal_mega.dataplane.journal.segments_to_retire`),
  so a resume that falls back from a corrupt newest checkpoint to an older one replays every
  sample accepted since the older one;
* on recovery the buffer of the checkpoint is loaded and the journal since it replayed: the
  buffer's dedup drops what is pending or was trained before the checkpoint, so samples that
  arrived later, or were trained in steps the crash rolled back, are pending again; a record
  that fails its checksum is skipped and counted (``journal/corrupt_records``), never trained.
The intake also keeps the prompts whose whole group it journaled
(:class:`~areal_mega.dataplane.prompt_ledger.PromptLedger`, saved with each checkpoint) for the
rollout worker's exact resume.
With routing replay (``route_layout``) a trajectory whose ``token_extras.routed_experts`` does
not fit the model (shape ``(L, MoE layers, topk)``, ids in ``[-1, num_experts)``) is refused on
arrival like a message that fails its wire checks: counted under ``invalid_field``
(``dataplane/rejected``), logged with the sample id and expected vs got, never journaled.
A trajectory with images is checked against the model's
:class:`~areal_mega.dataplane.multimodal.VisionSpec` on arrival (a text model refuses images),
refused under ``invalid_field`` likewise; journal and buffer files keep the images.
Samples the trainer died on twice are quarantined (:mod:`areal_mega.train.quarantine`,
``quarantine`` here: loaded at start, applied by the step's entry screen).
``trained.jsonl`` records which samples each step trained on (truncated on resume to the
checkpoint's step), so a run's lineage can be audited.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Optional

from areal_mega.common.files import atomic_write
from areal_mega.common.moe_routes import RouteLayout, check_routes
from areal_mega.dataplane.buffer import TrajectoryBuffer
from areal_mega.dataplane.journal import (
    ReplayStats,
    TrajectoryJournal,
    segment_number,
    segments_to_retire,
)
from areal_mega.dataplane.multimodal import VisionSpec
from areal_mega.dataplane.prompt_ledger import PromptLedger
from areal_mega.dataplane.transport import TrajectoryReceiver
from areal_mega.dataplane.wire import WireError
from areal_mega.run_dir import checkpoint_meta, complete_checkpoints
from areal_mega.train.quarantine import Quarantine

log = logging.getLogger(__name__)


class TrajectoryIntake:
    """Receives, journals and buffers trajectories in a background thread (trainer rank 0)."""

    def __init__(
        self,
        endpoint: str,
        run_dir: str | os.PathLike,
        *,
        group_size: int,
        secret: Optional[str] = None,
        max_queue: int = 1024,
        max_message_bytes: int = 1 << 30,
        allow_remote: bool = False,
        route_layout: Optional[RouteLayout] = None,
        vision: Optional[VisionSpec] = None,
    ):
        """``route_layout``: the model's MoE route layout when routing replay is on (arriving
        routes are checked against it), else None. ``vision``: a vision-language model's
        :class:`~areal_mega.dataplane.multimodal.VisionSpec` (arriving images are checked
        against it and the tokens), None for a text model (a sample with images is refused)."""
        self.run_dir = Path(run_dir)
        self.route_layout = route_layout
        # no sample cap here: journaled samples are accepted (see _pump); memory is bounded by
        # the receiver's queue, the senders' ack windows and the staleness bound
        self.buffer = TrajectoryBuffer(group_size)
        self.journal_dir = self.run_dir / "journal"
        self.trained_path = self.run_dir / "trained.jsonl"
        self.receiver = TrajectoryReceiver(
            endpoint,
            secret=secret,
            max_queue=max_queue,
            max_message_bytes=max_message_bytes,
            allow_remote=allow_remote,
            vision=vision,
        )
        self.journal = TrajectoryJournal(self.journal_dir)
        self.quarantine = Quarantine(self.run_dir)  # samples the trainer died on, twice
        self.quarantine.load()
        self.n_accepted = 0  # samples journaled in this run's lineage
        self.prompt_ledger = PromptLedger()  # prompts whose whole group was journaled
        self.replay_stats = ReplayStats()  # what the last restore found in the journal
        self._pump_lock = threading.Lock()  # held while a checkpoint snapshots the intake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="trajectory-intake", daemon=True)

    def start(self) -> "TrajectoryIntake":
        self._thread.start()
        return self

    def _pump(self) -> None:
        while not self._stop.is_set():
            batch = self.receiver.recv_many(256, timeout=0.1)
            if self.route_layout is not None:
                batch = [t for t in batch if self._routes_fit(t)]
            if not batch:
                continue
            with self._pump_lock:
                self.journal.append(batch)  # durable before it counts as accepted
                self.n_accepted += len(batch)
                for t in batch:
                    self.prompt_ledger.add(t)
                    # restored semantics: journaled samples are accepted; capacity is bounded
                    # by the senders' windows and the staleness bound, never by dropping
                    self.buffer.put_restored(t)

    def _routes_fit(self, traj) -> bool:
        """Whether ``traj``'s routes fit the model; a misfit is refused (see the module doc)."""
        problem = check_routes(traj, self.route_layout)
        if problem is not None:
            self.receiver.reject(WireError("invalid_field", problem))
        return problem is None

    def restore(
        self,
        buffer_file: Optional[str],
        step: int,
        accepted_before: int = 0,
        prompt_ledger: Optional[dict] = None,
        journal_from: Optional[int] = None,
    ) -> int:
        """Recovery: load the checkpoint's buffer, replay the journal segments written since
        that checkpoint (numbered ``journal_from`` on; all when None), truncate the trained
        log. Returns the samples made pending again.
        ``prompt_ledger``: the checkpoint's :class:`PromptLedger` state (None: empty).
        Corrupt journal records are skipped, never trained, and counted in
        ``replay_stats.corrupt`` (``journal/corrupt_records`` in :meth:`stats`)."""
        if buffer_file is not None and Path(buffer_file).exists():
            self.buffer = TrajectoryBuffer.load(buffer_file)
        n_new = n_seen = 0
        self.replay_stats = ReplayStats()
        self.prompt_ledger = PromptLedger(prompt_ledger)
        for t in TrajectoryJournal.replay(self.journal_dir, self.replay_stats, since=journal_from):
            n_seen += 1
            self.prompt_ledger.add(t)
            n_new += bool(self.buffer.put_restored(t))
        self.n_accepted = accepted_before + n_seen
        truncate_jsonl(self.trained_path, step)
        return n_new

    def snapshot(self, buffer_file: str) -> tuple:
        """For a checkpoint: start a new journal segment and save the buffer, atomically with
        respect to the intake. Returns (the new segment's number: the checkpoint's
        ``journal_from``, samples accepted so far, the prompt ledger's state)."""
        with self._pump_lock:
            first = self.journal.rotate()
            self.buffer.save(buffer_file)
            return first, self.n_accepted, self.prompt_ledger.state()

    def after_checkpoint(self, ckpt_root: str | os.PathLike) -> list:
        """Once a checkpoint is complete (and older ones pruned): delete the journal segments
        no checkpoint kept under ``ckpt_root`` needs (a fallback to any of them replays from
        its ``journal_from``) and the buffer files of pruned checkpoints. Returns the segment
        numbers deleted."""
        root = Path(ckpt_root)
        kept = complete_checkpoints(root)
        kept_from = [_journal_from(p) for p in kept]
        doomed = segments_to_retire([segment_number(p) for p in self.journal.segments()], kept_from)
        self.journal.retire(doomed)
        live = {p.name for p in kept}
        for f in root.glob("buffer_iter_*.bin"):
            if f.name.replace("buffer_", "").replace(".bin", "") not in live:
                f.unlink(missing_ok=True)
        return doomed

    def next_groups(self, n_groups: int, timeout: Optional[float] = None):
        """The ``n_groups`` oldest complete groups, flattened to a list of trajectories."""
        groups = self.buffer.get_groups(n_groups, timeout=timeout)
        return [t for g in groups for t in g]

    def record_trained(self, step: int, sample_ids: list) -> None:
        with open(self.trained_path, "a") as f:
            f.write(json.dumps({"step": step, "sample_ids": list(sample_ids)}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def stats(self) -> dict:
        """Metrics: ``dataplane/*`` (receiver), ``buffer/*`` and the journal records the last
        restore skipped as corrupt (``journal/corrupt_records``)."""
        s = {
            f"dataplane/{k}": float(v)
            for k, v in self.receiver.stats().items()
            if isinstance(v, (int, float))
        }
        s.update(
            {
                f"buffer/{k}": float(v)
                for k, v in self.buffer.stats().items()
                if isinstance(v, (int, float))
            }
        )
        s["journal/corrupt_records"] = float(self.replay_stats.corrupt)
        s.update(self.quarantine.stats())
        return s

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.receiver.close()
        self.journal.close()


def _journal_from(ckpt) -> Optional[int]:
    """Checkpoint ``ckpt``'s first journal segment; None when unknown (written before the
    record, or its metadata unreadable: then every segment is kept)."""
    try:
        return checkpoint_meta(ckpt).get("extra", {}).get("journal_from")
    except ValueError:
        return None


def truncate_jsonl(path: str | os.PathLike, step: int) -> None:
    """Drop lines whose ``step`` is greater than ``step`` (rolled back by a resume); the
    rewrite is atomic and durable, like the fsync'd appends of ``record_trained``."""
    path = Path(path)
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            break  # a torn last line
    atomic_write(path, "".join(k + "\n" for k in keep), durable=True)

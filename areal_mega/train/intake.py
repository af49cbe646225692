"""Trainer-side intake of trajectories: ZMQ receiver -> write-ahead journal -> buffer (rank 0).

Nothing accepted is lost on a crash:
* every trajectory is appended to ``<run_dir>/accepted.journal`` (the wire encoding, fsync'd)
  before it enters the :class:`~areal_mega.dataplane.buffer.TrajectoryBuffer`;
* each checkpoint stores the buffer (pending samples + the ids already trained on);
* on recovery the buffer of the checkpoint is loaded and the journal replayed into it: the
  buffer's dedup drops what is pending or was trained before the checkpoint, so samples that
  arrived later, or were trained in steps the crash rolled back, are pending again.
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

import msgpack

from areal_mega.dataplane.buffer import TrajectoryBuffer
from areal_mega.dataplane.transport import TrajectoryReceiver
from areal_mega.dataplane.wire import WireError, decode_trajectory, encode_trajectory

log = logging.getLogger(__name__)


class TrajectoryJournal:
    """Append-only, fsync'd log of accepted trajectories (msgpack records of wire frames)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self._packer = msgpack.Packer(use_bin_type=True)
        self._lock = threading.Lock()

    def append(self, trajs) -> None:
        with self._lock:
            for t in trajs:
                frames = [bytes(memoryview(f)) for f in encode_trajectory(t)]
                self._f.write(self._packer.pack(frames))
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        with self._lock:
            self._f.close()

    @staticmethod
    def replay(path: str | os.PathLike):
        """Yield the journal's trajectories; a record cut short by a crash ends the replay."""
        path = Path(path)
        if not path.exists():
            return
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 31)
        with open(path, "rb") as f:
            unpacker.feed(f.read())
        i = 0
        while True:
            try:
                rec = unpacker.unpack()
            except msgpack.OutOfData:
                return
            except Exception as e:  # noqa: BLE001 - a torn tail after a crash
                log.warning("%s: record %d unreadable (%s); replay stops there", path, i, e)
                return
            try:
                yield decode_trajectory(rec)
            except WireError as e:
                log.warning("%s: record %d rejected: %s", path, i, e)
            i += 1


class TrajectoryIntake:
    """Receives, journals and buffers trajectories in a background thread (trainer rank 0)."""

    def __init__(self, endpoint: str, run_dir: str | os.PathLike, *, group_size: int,
                 secret: Optional[str] = None, max_pending: Optional[int] = None,
                 buffer: Optional[TrajectoryBuffer] = None):
        self.run_dir = Path(run_dir)
        self.buffer = buffer or TrajectoryBuffer(group_size, max_pending=max_pending)
        self.journal_path = self.run_dir / "accepted.journal"
        self.trained_path = self.run_dir / "trained.jsonl"
        self.receiver = TrajectoryReceiver(endpoint, secret=secret)
        self.journal = TrajectoryJournal(self.journal_path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="trajectory-intake", daemon=True)

    def start(self) -> "TrajectoryIntake":
        self._thread.start()
        return self

    def _pump(self) -> None:
        while not self._stop.is_set():
            batch = self.receiver.recv_many(256, timeout=0.1)
            if not batch:
                continue
            self.journal.append(batch)  # durable before it counts as accepted
            for t in batch:
                while not self._stop.is_set():
                    try:
                        self.buffer.put(t, timeout=0.5)
                        break
                    except TimeoutError:
                        continue  # buffer full: backpressure reaches the senders

    def restore(self, buffer_file: Optional[str], step: int) -> int:
        """Recovery: load the checkpoint's buffer, replay the journal, truncate the trained log.
        Returns the number of samples made pending again from the journal."""
        if buffer_file is not None and Path(buffer_file).exists():
            restored = TrajectoryBuffer.load(buffer_file, max_pending=self.buffer.max_pending)
            self.buffer = restored
        n_new = 0
        for t in TrajectoryJournal.replay(self.journal_path):
            n_new += bool(self.buffer.put(t))
        truncate_jsonl(self.trained_path, step)
        return n_new

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
        s = {f"dataplane/{k}": float(v) for k, v in self.receiver.stats().items()
             if isinstance(v, (int, float))}
        s.update({f"buffer/{k}": float(v) for k, v in self.buffer.stats().items()
                  if isinstance(v, (int, float))})
        return s

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.receiver.close()
        self.journal.close()


def truncate_jsonl(path: str | os.PathLike, step: int) -> None:
    """Drop lines whose ``step`` is greater than ``step`` (rolled back by a resume)."""
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
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)

"""Write-ahead journal of accepted trajectories: numbered, fsync'd segment files.

The trainer's intake appends every accepted trajectory here before it enters the buffer; a
checkpoint rotates to a new segment and retires the ones it covers; recovery (and the rollout
worker's count of accepted samples) replays what is left. Records use the same encoding as the
buffer files (:func:`areal_mega.dataplane.wire.encode_record`).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import msgpack

from areal_mega.dataplane.wire import WireError, decode_trajectory, encode_record

log = logging.getLogger(__name__)


class TrajectoryJournal:
    """Append-only, fsync'd log of accepted trajectories (msgpack records of wire frames),
    as numbered segment files ``<dir>/NNNNNNNN.journal`` so that checkpoints can retire the
    segments they cover (:meth:`rotate`)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._lock = threading.Lock()
        self._f = None
        self._open_next()

    def segments(self) -> list:
        return sorted(self.dir.glob("*.journal"))

    def _open_next(self) -> None:
        segs = self.segments()
        nxt = int(segs[-1].stem) + 1 if segs else 1
        self.path = self.dir / f"{nxt:08d}.journal"
        self._f = open(self.path, "ab")

    def append(self, trajs) -> None:
        with self._lock:
            for t in trajs:
                self._f.write(encode_record(t, self._packer))
            self._f.flush()
            os.fsync(self._f.fileno())

    def rotate(self) -> list:
        """Continue in a new segment; returns the earlier segments (to retire once the
        checkpoint that covers them is complete)."""
        with self._lock:
            self._f.close()
            old = self.segments()
            self._open_next()
            return old

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    @staticmethod
    def replay(directory: str | os.PathLike):
        """Yield the trajectories of every segment in order; a record cut short by a crash
        ends that segment's replay."""
        for path in sorted(Path(directory).glob("*.journal")):
            yield from _replay_segment(path)


def _replay_segment(path: Path):
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

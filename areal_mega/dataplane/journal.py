"""Write-ahead journal of accepted trajectories: numbered, fsync'd segment files.

The trainer's intake appends every accepted trajectory here before it enters the buffer; a
checkpoint rotates to a new segment and records its number (``journal_from``); recovery from a
checkpoint (and the rollout worker's count of accepted samples) replays the segments from that
number on. A segment is retired only once no kept checkpoint can need it
(:func:`segments_to_retire`): a resume that falls back from a corrupt newest checkpoint to an
older one still finds every sample accepted since the older one.

Each record is framed and checksummed (format 2)::

    magic b"\\xc1AJ2" | payload length: u64 LE | crc32(payload): u32 LE
        | crc32(the 16 bytes before): u32 LE | payload

where the payload is :func:`areal_mega.dataplane.wire.encode_record` (the buffer files'
encoding; they carry a whole-file SHA-256 of their own). The header checksum makes the length
trustworthy, so a record whose payload fails its checksum is skipped by its length and replay
goes on with the next record; a record whose header fails is skipped up to the next valid
header. Either way the record is counted (:class:`ReplayStats`) and logged with its segment
and index, and never replayed. A record cut short by a crash (the file ends inside it, or only
zero bytes follow) ends that segment's replay quietly. ``0xc1`` is the one byte msgpack never
uses, so a segment of the unframed format 1 (a bare msgpack array) is told apart from its first
byte and refused with :class:`JournalError` (see :func:`replay_segment`).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import msgpack

from areal_mega.dataplane.wire import decode_trajectory, encode_record

log = logging.getLogger(__name__)

MAGIC = b"\xc1AJ2"
"""First bytes of every record (``0xc1`` is never valid msgpack)."""
_HEADER = struct.Struct("<4sQII")
HEADER_BYTES = _HEADER.size
_LEGACY_FIRST_BYTES = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
"""A format-1 segment starts with a msgpack array (fixarray, array 16, array 32)."""


class JournalError(ValueError):
    """A journal segment that cannot be replayed at all (names the file)."""


@dataclass
class ReplayStats:
    """What a replay found: ``records`` replayed, ``corrupt`` records skipped (checksum or
    decode failure, never replayed), ``torn`` segments whose tail a crash cut short."""

    segments: int = 0
    records: int = 0
    corrupt: int = 0
    torn: int = 0


def record_header(payload: bytes) -> bytes:
    """The checksummed header that precedes ``payload`` on disk."""
    head = MAGIC + struct.pack("<QI", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head))


class TrajectoryJournal:
    """Append-only, fsync'd log of accepted trajectories (checksummed records, see the module
    docstring), as numbered segment files ``<dir>/NNNNNNNN.journal``: a checkpoint starts a new one
    (:meth:`rotate`) and the segments no kept checkpoint needs are retired (:meth:`retire`,
    :func:`segments_to_retire`)."""

    def __init__(self, directory: str | os.PathLike, private: bool = False):
        """``private``: the segment files are created with mode 0600 (they may hold what
        only the run's owner may read, e.g. the online agents' conversations)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.private = private
        self._packer = msgpack.Packer(use_bin_type=True)
        self._lock = threading.Lock()
        self._f = None
        self._open_next()

    def segments(self) -> list:
        """The segment files of this journal, oldest first."""
        return sorted(self.dir.glob("*.journal"))

    @property
    def current(self) -> int:
        """The number of the segment appends go to now."""
        return segment_number(self.path)

    def _open_next(self) -> None:
        segs = self.segments()
        nxt = int(segs[-1].stem) + 1 if segs else 1
        self.path = self.dir / f"{nxt:08d}.journal"
        if self.private:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.fchmod(fd, 0o600)
            self._f = os.fdopen(fd, "ab")
        else:
            self._f = open(self.path, "ab")

    def append(self, trajs) -> None:
        """Append ``trajs`` to the current segment; durable (fsync'd) when this returns."""
        with self._lock:
            for t in trajs:
                payload = encode_record(t, self._packer)
                self._f.write(record_header(payload))
                self._f.write(payload)
            self._f.flush()
            os.fsync(self._f.fileno())

    def rotate(self) -> int:
        """Continue in a new segment; returns its number (a checkpoint taken now records it
        as its ``journal_from``: the segments a resume from it replays)."""
        with self._lock:
            self._f.close()
            self._open_next()
            return self.current

    def retire(self, numbers) -> None:
        """Delete the segments numbered ``numbers`` (never the current one)."""
        with self._lock:
            for n in numbers:
                if int(n) != self.current:
                    (self.dir / f"{int(n):08d}.journal").unlink(missing_ok=True)

    def close(self) -> None:
        """Close the current segment."""
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    @staticmethod
    def replay(
        directory: str | os.PathLike,
        stats: Optional[ReplayStats] = None,
        since: Optional[int] = None,
    ):
        """Yield the trajectories of every segment numbered ``since`` or later (all of them
        when None) in order, skipping (and counting in ``stats``) corrupt records; a record
        cut short by a crash ends that segment's replay. Raises :class:`JournalError` for a
        segment of the unframed format 1."""
        stats = ReplayStats() if stats is None else stats
        for path in sorted(Path(directory).glob("*.journal")):
            if since is None or segment_number(path) >= since:
                yield from replay_segment(path, stats)


def segment_number(path: str | os.PathLike) -> int:
    """The number of segment file ``NNNNNNNN.journal``."""
    return int(Path(path).stem)


def segments_to_retire(segments: list, kept_from: list) -> list:
    """Which journal segments no kept checkpoint needs (pure).

    ``segments``: the segment numbers on disk; ``kept_from``: for each checkpoint still kept,
    the first segment written after it (its ``journal_from``), or None for a checkpoint that
    predates the record (its segments are unknown, so every segment is kept while it is).
    A resume from any kept checkpoint replays the segments from its ``journal_from`` on, so
    those below the smallest are retired; nothing is retired while no checkpoint is kept.
    Returns the numbers to delete, in order."""
    if not kept_from or any(k is None for k in kept_from):
        return []
    floor = min(int(k) for k in kept_from)
    return sorted(int(n) for n in segments if int(n) < floor)


def _valid_header(data, pos: int) -> Optional[tuple]:
    """``(length, payload crc)`` of a record header at ``pos`` whose magic and header checksum
    hold, else None."""
    if len(data) - pos < HEADER_BYTES:
        return None
    magic, n, pcrc, hcrc = _HEADER.unpack_from(data, pos)
    if magic != MAGIC or zlib.crc32(data[pos : pos + HEADER_BYTES - 4]) != hcrc:
        return None
    return n, pcrc


def _resync(data: bytes, pos: int) -> int:
    """Offset of the next valid record header after ``pos`` (``len(data)`` when none)."""
    at = pos
    while True:
        at = data.find(MAGIC, at + 1)
        if at < 0:
            return len(data)
        if _valid_header(data, at) is not None:
            return at


def replay_segment(path: Path, stats: Optional[ReplayStats] = None):
    """Yield the trajectories of one segment file (see :meth:`TrajectoryJournal.replay`).

    A segment of format 1 (unframed records, written before checksums existed) is refused with
    a :class:`JournalError` naming the file rather than replayed: its records cannot be checked,
    and a journal only outlives the checkpoint after it when a run stopped in between, so the
    remedy is rare and explicit (delete the segment: the samples since the last checkpoint are
    lost to training and the rollout generates new ones).
    """
    stats = ReplayStats() if stats is None else stats
    raw = path.read_bytes()
    data = memoryview(raw)  # payloads are sliced without a copy
    stats.segments += 1
    if len(data) and data[0] in _LEGACY_FIRST_BYTES:
        raise JournalError(
            f"{path}: journal segment in the unchecksummed format of an earlier "
            "version; its records cannot be verified. Delete it to resume "
            "(its samples since the last checkpoint are not trained)"
        )
    pos = idx = 0
    end = len(data)
    while pos < end:
        head = _valid_header(data, pos)
        if head is None:
            if end - pos < HEADER_BYTES or raw.count(0, pos) == end - pos:
                _torn(path, idx, pos, stats)  # crash inside a header, or zero-filled blocks
                return
            nxt = _resync(raw, pos)
            _corrupt(path, idx, pos, stats, f"record header corrupt; bytes [{pos}, {nxt}) skipped")
            pos, idx = nxt, idx + 1
            continue
        n, pcrc = head
        start = pos + HEADER_BYTES
        if n > end - start:
            _torn(path, idx, pos, stats)
            return
        payload = data[start : start + n]
        pos, idx = start + n, idx + 1
        if zlib.crc32(payload) != pcrc:
            _corrupt(path, idx - 1, start - HEADER_BYTES, stats, "payload checksum mismatch")
            continue
        try:
            traj = decode_trajectory(msgpack.unpackb(payload, raw=False))
        except Exception as e:  # noqa: BLE001 - msgpack raises several types; WireError too
            _corrupt(
                path,
                idx - 1,
                start - HEADER_BYTES,
                stats,
                f"checksum holds but the record does not decode: {e}",
            )
            continue
        stats.records += 1
        yield traj


def _corrupt(path: Path, idx: int, pos: int, stats: ReplayStats, why: str) -> None:
    stats.corrupt += 1
    log.warning("journal %s: record %d (byte %d) skipped, not replayed: %s", path, idx, pos, why)


def _torn(path: Path, idx: int, pos: int, stats: ReplayStats) -> None:
    stats.torn += 1
    log.info(
        "journal %s: record %d (byte %d) cut short by a crash; the segment ends there",
        path,
        idx,
        pos,
    )

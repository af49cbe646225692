"""Trainer-side trajectory buffer: dedup, oldest-first whole prompt groups, checkpointable.

* **Dedup** by ``sample_id`` over pending samples and the last ``dedup_window`` consumed ones
  (a retried send or a replay after a rollout restart is dropped and counted).
* **Groups**: a group (same ``group_id``) is complete when it holds ``group_size`` samples
  (``traj.meta["group_size"]`` overrides the buffer default per group, e.g. after dynamic
  filtering). :meth:`get_groups` hands out complete groups only, in arrival order (of each
  group's first sample). The rollout side delivers groups in the order they were started
  (:class:`~areal_mega.rollout.controller.RolloutController`), so the trainer consumes in
  start order, which is what makes the staleness bound exact; a save/load keeps the order.
  Samples inside a group are ordered by ``(created_at, sample_id)``.
* **Staleness**: every group reports its min / max weight version; :meth:`get_groups` can skip
  groups older than ``min_version`` (they stay), :meth:`drop_stale` removes them, and
  :meth:`stats` reports counts and the version range.
* **Capacity** (``max_pending`` samples): when full, a sample that *starts* a new group waits
  (``put`` blocks), while a sample of an already-open group is always admitted, so a full
  buffer cannot deadlock on groups that can never complete.
* **Persistence**: :meth:`save` writes every pending sample (wire encoding, no pickle) plus the
  dedup window to a temp file, fsyncs and renames it over the target (atomic);
  :meth:`load` restores it after checking a SHA-256 of the content.

Thread-safe: one thread may :meth:`pump` from a receiver while the trainer calls
:meth:`get_groups`.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import threading
from typing import Iterable, Optional

import msgpack

from areal_mega.common.files import atomic_open
from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.dataplane.wire import WireError, decode_trajectory, encode_record

_MAGIC = b"AREAL-MEGA-TRAJBUF\n"
_FORMAT_VERSION = 1


class BufferFileError(ValueError):
    """A saved buffer file is truncated, corrupted or of an unknown format."""


class _Group:
    __slots__ = ("group_id", "size", "samples", "finished_at", "seq")

    def __init__(self, group_id: str, size: int, seq: int = 0):
        self.group_id = group_id
        self.size = size
        self.samples: list[Trajectory] = []
        self.finished_at = float("-inf")
        self.seq = seq  # arrival order of the group's first sample

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.size

    def min_version(self) -> int:
        vs = [v for v in (t.min_version for t in self.samples) if v >= 0]
        return min(vs) if vs else -1

    def max_version(self) -> int:
        return max((t.max_version for t in self.samples), default=-1)

    def sort_key(self):
        return self.seq


class TrajectoryBuffer:
    """Pending trajectories grouped by prompt; see the module docstring for the semantics."""

    def __init__(
        self,
        group_size: int = 1,
        *,
        max_pending: Optional[int] = None,
        dedup_window: int = 1_000_000,
    ):
        if group_size < 1:
            raise ValueError(f"group_size={group_size} must be >= 1")
        self.group_size = int(group_size)
        self.max_pending = max_pending
        self.dedup_window = int(dedup_window)
        self._groups: dict[str, _Group] = {}
        self._pending_ids: set[str] = set()
        self._consumed: collections.deque = collections.deque()
        self._consumed_ids: set[str] = set()
        self._arrivals = itertools.count()
        self._n_pending = 0
        self._cond = threading.Condition()
        self.duplicates = 0
        self.accepted = 0
        self.consumed = 0
        self.dropped_stale = 0

    # ------------------------------------------------------------------ intake
    def put(
        self, traj: Trajectory, timeout: Optional[float] = None, *, ignore_capacity: bool = False
    ) -> bool:
        """Add one trajectory; returns False (and counts it) if its ``sample_id`` was seen.

        Blocks while the buffer is full and ``traj`` would open a new group; raises
        ``TimeoutError`` after ``timeout`` seconds of waiting. ``ignore_capacity`` admits it
        regardless (samples restored from a checkpoint or a journal were accepted already).
        """
        gid = traj.group_id or traj.sample_id
        with self._cond:
            if traj.sample_id in self._pending_ids or traj.sample_id in self._consumed_ids:
                self.duplicates += 1
                return False
            if self.max_pending is not None and gid not in self._groups and not ignore_capacity:
                ok = self._cond.wait_for(lambda: self._n_pending < self.max_pending, timeout)
                if not ok:
                    raise TimeoutError(
                        f"buffer full ({self._n_pending} pending samples) for "
                        f"{timeout} s; sample_id={traj.sample_id!r} not added"
                    )
                if traj.sample_id in self._pending_ids or traj.sample_id in self._consumed_ids:
                    self.duplicates += 1
                    return False
            g = self._groups.get(gid)
            if g is None:
                size = traj.meta.get("group_size", self.group_size)
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    size = self.group_size
                g = self._groups[gid] = _Group(gid, size, next(self._arrivals))
            g.samples.append(traj)
            g.finished_at = max(g.finished_at, float(traj.created_at))
            self._pending_ids.add(traj.sample_id)
            self._n_pending += 1
            self.accepted += 1
            self._cond.notify_all()
            return True

    def put_many(self, trajs: Iterable[Trajectory]) -> int:
        """Add several; returns how many were new."""
        return sum(self.put(t) for t in trajs)

    def pump(self, receiver, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Move trajectories from a :class:`TrajectoryReceiver` into the buffer until ``stop``.

        Run it in one thread; that thread then owns the receiver's socket. While the buffer is
        full it stops reading, so backpressure reaches the senders.
        """
        while not stop.is_set():
            t = receiver.recv(poll_s)
            if t is None:
                continue
            while not stop.is_set():
                try:
                    self.put(t, timeout=poll_s)
                    break
                except TimeoutError:
                    continue

    def start_pump(self, receiver) -> tuple[threading.Thread, threading.Event]:
        """Start :meth:`pump` in a daemon thread; set the returned event and join to stop."""
        stop = threading.Event()
        th = threading.Thread(
            target=self.pump, args=(receiver, stop), daemon=True, name="trajectory-pump"
        )
        th.start()
        return th, stop

    # ------------------------------------------------------------------ output
    def _eligible(self, min_version: Optional[int]) -> list[_Group]:
        out = [
            g
            for g in self._groups.values()
            if g.complete and (min_version is None or g.min_version() >= min_version)
        ]
        out.sort(key=_Group.sort_key)
        return out

    def _take(self, groups: list[_Group]) -> list[list[Trajectory]]:
        result = []
        for g in groups:
            del self._groups[g.group_id]
            samples = sorted(g.samples, key=lambda t: (t.created_at, t.sample_id))
            for t in samples:
                self._pending_ids.discard(t.sample_id)
                self._remember(t.sample_id)
            self._n_pending -= len(samples)
            self.consumed += len(samples)
            result.append(samples)
        self._cond.notify_all()
        return result

    def _remember(self, sample_id: str) -> None:
        self._consumed.append(sample_id)
        self._consumed_ids.add(sample_id)
        while len(self._consumed) > self.dedup_window:
            self._consumed_ids.discard(self._consumed.popleft())

    def get_groups(
        self,
        n_groups: int,
        timeout: Optional[float] = None,
        *,
        min_version: Optional[int] = None,
        allow_partial: bool = False,
    ) -> list[list[Trajectory]]:
        """Remove and return the ``n_groups`` oldest complete groups (each a list of samples).

        Waits up to ``timeout`` seconds (None: forever) until that many are complete. On
        timeout returns ``[]`` and takes nothing, or with ``allow_partial`` whatever complete
        groups there are. Groups whose min version is below ``min_version`` are left in place.
        """
        if n_groups < 1:
            raise ValueError(f"n_groups={n_groups} must be >= 1")
        with self._cond:
            ready = self._cond.wait_for(
                lambda: len(self._eligible(min_version)) >= n_groups, timeout
            )
            groups = self._eligible(min_version)
            if not ready and not allow_partial:
                return []
            return self._take(groups[:n_groups])

    def drop_stale(self, min_version: int) -> list[str]:
        """Remove every group (complete or not) holding a sample older than ``min_version``.

        Returns the dropped sample ids (counted in ``dropped_stale``). Note that the default
        policy is to keep late samples (the staleness bound holds prompts back instead).
        """
        with self._cond:
            stale = [g for g in self._groups.values() if 0 <= g.min_version() < min_version]
            ids = [t.sample_id for g in stale for t in g.samples]
            self._take(stale)
            self.consumed -= len(ids)
            self.dropped_stale += len(ids)
            return ids

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        return self._n_pending

    @property
    def n_complete_groups(self) -> int:
        """Groups ready to be handed out."""
        with self._cond:
            return sum(g.complete for g in self._groups.values())

    def pending(self) -> list[Trajectory]:
        """Every pending sample (complete groups first, oldest first), without removing."""
        with self._cond:
            gs = sorted(self._groups.values(), key=lambda g: (not g.complete, g.sort_key()))
            return [
                t for g in gs for t in sorted(g.samples, key=lambda t: (t.created_at, t.sample_id))
            ]

    def stats(self) -> dict:
        """Counters and staleness figures as a plain dict."""
        with self._cond:
            groups = list(self._groups.values())
            vmins = [g.min_version() for g in groups if g.min_version() >= 0]
            return {
                "pending_samples": self._n_pending,
                "complete_groups": sum(g.complete for g in groups),
                "incomplete_groups": sum(not g.complete for g in groups),
                "accepted": self.accepted,
                "consumed": self.consumed,
                "duplicates": self.duplicates,
                "dropped_stale": self.dropped_stale,
                "min_version": min(vmins) if vmins else -1,
                "max_version": max((g.max_version() for g in groups), default=-1),
            }

    # ------------------------------------------------------------------ persistence
    def save(self, path: str) -> None:
        """Atomically and durably (fsync'd) write pending samples and the dedup window to
        ``path`` (no pickle)."""
        with self._cond:
            samples = [t for g in self._groups.values() for t in g.samples]
            state = {
                "format": "areal-mega-trajectory-buffer",
                "version": _FORMAT_VERSION,
                "group_size": self.group_size,
                "n_samples": len(samples),
                "consumed_ids": list(self._consumed),
                "counters": {
                    "accepted": self.accepted,
                    "consumed": self.consumed,
                    "duplicates": self.duplicates,
                    "dropped_stale": self.dropped_stale,
                },
            }
            packer = msgpack.Packer(use_bin_type=True)
            records = [encode_record(t, packer) for t in samples]
        h = hashlib.sha256()
        with atomic_open(path, "wb", durable=True) as f:
            for chunk in [_MAGIC, packer.pack(state)] + records:
                h.update(chunk)
                f.write(chunk)
            f.write(h.digest())

    @classmethod
    def load(
        cls, path: str, *, max_pending: Optional[int] = None, dedup_window: int = 1_000_000
    ) -> "TrajectoryBuffer":
        """Restore a buffer written by :meth:`save`; raises :class:`BufferFileError`."""
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < len(_MAGIC) + 32 or not data.startswith(_MAGIC):
            raise BufferFileError(f"{path}: not a trajectory buffer file (bad magic or too short)")
        body, digest = data[:-32], data[-32:]
        if hashlib.sha256(body).digest() != digest:
            raise BufferFileError(f"{path}: checksum mismatch (truncated or corrupted)")
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(body))
        unpacker.feed(body[len(_MAGIC) :])
        state = next(unpacker, None)
        if not isinstance(state, dict) or state.get("version") != _FORMAT_VERSION:
            raise BufferFileError(
                f"{path}: unknown format version "
                f"{state.get('version') if isinstance(state, dict) else None}"
            )
        buf = cls(state["group_size"], max_pending=max_pending, dedup_window=dedup_window)
        for sid in state["consumed_ids"]:
            buf._remember(sid)
        n = 0
        for i, rec in enumerate(unpacker):
            try:
                traj = decode_trajectory(rec)
            except WireError as e:
                raise BufferFileError(f"{path}: record {i}: {e}") from None
            buf.put_restored(traj)
            n += 1
        if n != state["n_samples"]:
            raise BufferFileError(f"{path}: {n} records, header says {state['n_samples']}")
        for k, v in state["counters"].items():
            setattr(buf, k, v)
        return buf

    def put_restored(self, traj: Trajectory) -> bool:
        """Add a sample recovered from a checkpoint or journal: never waits for capacity."""
        return self.put(traj, ignore_capacity=True)

    def wait_for(self, n_samples: int, timeout: Optional[float] = None) -> bool:
        """Block until at least ``n_samples`` are pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n_pending >= n_samples, timeout)


def oldest_first(trajs: Iterable[Trajectory]) -> list[Trajectory]:
    """Sort trajectories by ``(created_at, sample_id)``."""
    return sorted(trajs, key=lambda t: (t.created_at, t.sample_id))


__all__ = ["TrajectoryBuffer", "BufferFileError", "oldest_first"]

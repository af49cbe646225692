"""The online gateway's own journal, so that a SIGKILLed rollout worker loses no ended session
and reports the sessions it left open.

``<run_dir>/online/`` holds the trajectories of every *done* session (ended with its reward),
fsync'd as soon as it is done (a :class:`~areal_mega.dataplane.journal.TrajectoryJournal`,
appended again when a reward changes before delivery: the last record of a sample id wins),
``ended.jsonl``, one fsync'd line per session ended before its reward came (everything needed
to train it, :func:`~areal_mega.workflow.online_restore.ended_record`), and ``events.jsonl``,
one line per session started or dropped. They hold the agents' conversations: the directory
is 0700 and every file 0600. A resumed worker regenerates
exactly the prompt positions (slots) whose group the trainer lacks
(:mod:`areal_mega.rollout.resume`); for such a position the gateway delivers the journaled
sessions at once, with their original sample ids (a group the trainer had received already
is then dropped as a duplicate by its buffer), instead of waiting for new ones. A session
started and neither done nor dropped before the kill is counted dropped (``worker_restart``)
once, by the first worker that starts after it; a session ended but not yet rewarded is
``awaiting`` (its reward may still come: :mod:`areal_mega.workflow.online_restore`).

Sessions the trainer has accepted are retired: opening the journal reads the done sessions'
trajectories only for their session ids (none is kept in memory), and once the resume plan
is known :meth:`OnlineJournal.retire` keeps in memory, and on disk, only the done sessions of
prompt positions the trainer's accepted-prompt ledger lacks (generated again, or never
delivered), the sessions still awaiting their reward and the last drops (for a clear 410);
the rest of the directory is rewritten without them (built beside it, then swapped in, so a
kill at any point leaves the old or the new journal whole). A session the trainer has not
accepted is therefore never retired, and a restart holds the pending sessions only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from areal_mega.dataplane.journal import TrajectoryJournal

log = logging.getLogger(__name__)
KEEP_DROPS = 100_000  # drop events kept by a compaction (clear 410s; the book's bound)
COMPLETE = "COMPLETE"  # written last into a compacted copy: it may replace the journal


def _json_lines(path: Path):
    """The complete lines of a JSON-lines file, parsed (a line a kill cut short is skipped)."""
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:  # a line cut short by the kill
                continue


def _write_private(path: Path, lines) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        for rec in lines:
            f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish_swap(d: Path) -> None:
    """Complete a compaction a kill interrupted: ``<d>.new`` (whole when it holds
    :data:`COMPLETE`) replaces ``d``; leftovers of either side are removed."""
    new, old = d.with_name(d.name + ".new"), d.with_name(d.name + ".old")
    if new.exists() and not (new / COMPLETE).exists():
        shutil.rmtree(new)  # cut short while being built: the old one stands
    if new.exists():
        if d.exists():
            d.rename(old)
        new.rename(d)
        (d / COMPLETE).unlink()
        _fsync_dir(d.parent)
    if old.exists():
        shutil.rmtree(old)


def _append_handle(path: Path):
    """The append handle of a JSON-lines file whose records were read apart (its
    last line, cut short by a kill, is ended so that the next record starts on its own
    line)."""
    cut = False
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    handle = os.fdopen(fd, "a")
    if cut:
        handle.write("\n")
    return handle


def _reopen_jsonl(path: Path) -> tuple:
    """``(records, append handle)`` of a JSON-lines file: its complete lines parsed (a line a
    kill cut short is skipped, and ended so that the next record starts on its own line)."""
    text = path.read_text() if path.exists() else ""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by the kill
            continue
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # the agents' conversations: the run's owner only
    handle = os.fdopen(fd, "a")
    if text and not text.endswith("\n"):
        handle.write("\n")
    return records, handle


class OnlineJournal:
    """See the module doc. ``fresh``: a new run, so an earlier run's files are removed."""

    def __init__(self, directory, fresh: bool):
        self.dir = Path(directory)
        if fresh:
            for d in (self.dir, self.dir.with_name(self.dir.name + ".new")):
                if d.exists():
                    shutil.rmtree(d)
        _finish_swap(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        # prompt position -> {sample id: Trajectory}; read by retire() or the first restore()
        self.by_prompt: Optional[dict] = None
        done: set = set()  # session ids only: the trajectories stay on disk for now
        for t in TrajectoryJournal.replay(self.dir / "trajs"):
            done.add(t.meta.get("session_id"))
        started, dropped = [], {}
        events, self._events = _reopen_jsonl(self.dir / "events.jsonl")
        for ev in events:
            if ev.get("start"):
                started.append(ev["start"])
            elif ev.get("dropped"):
                dropped[ev["dropped"]] = ev.get("reason", "")
        ended: dict = {}  # session id -> its record while it still awaits its reward
        for rec in _json_lines(self.dir / "ended.jsonl"):
            sid = rec["session_id"]
            ended[sid] = None if sid in done or sid in dropped else rec
        self._ended = _append_handle(self.dir / "ended.jsonl")
        self.awaiting = [r for r in ended.values() if r is not None]
        self.left_open = [
            s for s in started if s not in done and s not in dropped and s not in ended
        ]
        self._trajs = TrajectoryJournal(self.dir / "trajs", private=True)
        self._positions: dict = {}  # segment written here -> prompt positions it holds
        for sid in self.left_open:
            self.dropped(sid, "worker_restart")
            dropped[sid] = "worker_restart"
        self.dropped_before = dropped  # session id -> why it was dropped (clear errors)

    def _event(self, ev: dict) -> None:
        # flushed, not fsync'd: it survives a killed process (what it is for), and after a
        # machine crash a lost start line only means one drop is not counted
        self._events.write(json.dumps(ev) + "\n")
        self._events.flush()

    def started(self, session_id: str, prompt_index) -> None:
        """A session started on the slot of ``prompt_index``."""
        self._event({"start": session_id, "prompt_index": prompt_index})

    def dropped(self, session_id: str, reason: str) -> None:
        """A session was dropped (it will not be counted again on restart)."""
        self._event({"dropped": session_id, "reason": reason})

    def ended(self, record: dict) -> None:
        """A session ended before its reward (:func:`~areal_mega.workflow.online_restore.
        ended_record`); durable when this returns."""
        self._ended.write(json.dumps(record) + "\n")
        self._ended.flush()
        os.fsync(self._ended.fileno())

    def done(self, trajs: list, restorable: bool = False) -> None:
        """A done session's trajectories (``meta``: ``prompt_index``, ``session_id``);
        durable when this returns. ``restorable``: also kept for :meth:`restore` (a session
        restored after a restart, rewarded now)."""
        self._trajs.append(trajs)
        self._positions.setdefault(self._trajs.current, set()).update(
            t.meta.get("prompt_index") for t in trajs
        )
        if restorable:
            if self.by_prompt is None:
                self.by_prompt = self._read_trajs(set())
            for t in trajs:
                self.by_prompt.setdefault(t.meta.get("prompt_index"), {})[t.sample_id] = t

    def restore(self, prompt_index) -> list:
        """The journaled trajectories of ``prompt_index`` (a slot being generated again), in
        journal order; each position is restored once. Without a :meth:`retire` before
        (no resume plan: e.g. a checkpoint older than the prompt ledger) the first call
        reads every journaled session."""
        if self.by_prompt is None:
            self.by_prompt = self._read_trajs(set())
        return list(self.by_prompt.pop(prompt_index, {}).values())

    def _read_trajs(self, accepted) -> dict:
        by_prompt: dict = {}
        for t in TrajectoryJournal.replay(self.dir / "trajs"):
            k = t.meta.get("prompt_index")
            if isinstance(k, int) and k not in accepted:
                by_prompt.setdefault(k, {})[t.sample_id] = t
        return by_prompt

    def retire(self, accepted) -> dict:
        """Retire the sessions the trainer has accepted: ``accepted`` holds the prompt
        positions whose whole group the trainer holds (its accepted-prompt ledger, the
        resume plan's). Keeps the done sessions of every other position (for
        :meth:`restore`), the sessions awaiting their reward and the last
        :data:`KEEP_DROPS` drops, in memory and on disk; the journal is rewritten without
        the rest. Call it before any session of this worker is journaled (the gateway does,
        before it serves). Returns ``{"bytes_before", "bytes_after", "sessions_kept",
        "positions_kept"}``."""
        before = _size(self.dir)
        self.by_prompt = self._read_trajs(set(accepted))
        kept_drops = list(self.dropped_before.items())[-KEEP_DROPS:]
        self.close()
        new = self.dir.with_name(self.dir.name + ".new")
        if new.exists():
            shutil.rmtree(new)
        new.mkdir(mode=0o700)
        trajs = TrajectoryJournal(new / "trajs", private=True)
        for by_sample in self.by_prompt.values():
            trajs.append(list(by_sample.values()))
        self._positions = {trajs.current: set(self.by_prompt)}
        trajs.close()
        _write_private(new / "ended.jsonl", self.awaiting)
        _write_private(
            new / "events.jsonl", ({"dropped": sid, "reason": why} for sid, why in kept_drops)
        )
        _fsync_dir(new / "trajs")
        _write_private(new / COMPLETE, ())
        _fsync_dir(new)
        _finish_swap(self.dir)
        self.dropped_before = dict(kept_drops)
        self._events = _append_handle(self.dir / "events.jsonl")
        self._ended = _append_handle(self.dir / "ended.jsonl")
        self._trajs = TrajectoryJournal(self.dir / "trajs", private=True)
        sessions = {t.meta.get("session_id") for b in self.by_prompt.values() for t in b.values()}
        out = {
            "bytes_before": before,
            "bytes_after": _size(self.dir),
            "sessions_kept": len(sessions) + len(self.awaiting),
            "positions_kept": len(self.by_prompt),
        }
        log.info(
            "online journal: sessions the trainer accepted retired (%d -> %d bytes); "
            "%d sessions of %d prompt positions and %d awaiting a reward kept",
            before,
            out["bytes_after"],
            len(sessions),
            len(self.by_prompt),
            len(self.awaiting),
        )
        return out

    def retire_segments(self, accepted) -> list:
        """While the gateway serves: delete the trajectory segments whose every session is of
        a prompt position in ``accepted`` (the trainer holds their groups; a checkpoint's
        ledger), after starting a new one; only segments written since this journal opened
        (or compacted by :meth:`retire`) are known. Returns the deleted segment numbers."""
        accepted = set(accepted)
        if self.by_prompt is not None:
            for k in [k for k in self.by_prompt if k in accepted]:
                del self.by_prompt[k]
        if not any(p <= accepted for n, p in self._positions.items()):
            return []
        self._trajs.rotate()
        gone = [n for n, p in self._positions.items() if n != self._trajs.current and p <= accepted]
        self._trajs.retire(gone)
        for n in gone:
            del self._positions[n]
        return gone

    def close(self) -> None:
        """Close the files (again: a no-op)."""
        self._trajs.close()
        self._events.close()
        self._ended.close()


def _size(directory: Path) -> int:
    """Bytes of the files under ``directory``."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())

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
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from areal_mega.dataplane.journal import TrajectoryJournal

log = logging.getLogger(__name__)


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
        if fresh and self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.by_prompt: dict = {}  # prompt position -> {sample id: Trajectory}
        done: set = set()
        for t in TrajectoryJournal.replay(self.dir / "trajs"):
            k = t.meta.get("prompt_index")
            if isinstance(k, int):
                self.by_prompt.setdefault(k, {})[t.sample_id] = t
            done.add(t.meta.get("session_id"))
        started, dropped = [], {}
        events, self._events = _reopen_jsonl(self.dir / "events.jsonl")
        for ev in events:
            if ev.get("start"):
                started.append(ev["start"])
            elif ev.get("dropped"):
                dropped[ev["dropped"]] = ev.get("reason", "")
        records, self._ended = _reopen_jsonl(self.dir / "ended.jsonl")
        ended = {rec["session_id"]: rec for rec in records}
        self.awaiting = [r for s, r in ended.items() if s not in done and s not in dropped]
        self.left_open = [
            s for s in started if s not in done and s not in dropped and s not in ended
        ]
        self._trajs = TrajectoryJournal(self.dir / "trajs", private=True)
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
        if restorable:
            for t in trajs:
                self.by_prompt.setdefault(t.meta.get("prompt_index"), {})[t.sample_id] = t

    def restore(self, prompt_index) -> list:
        """The journaled trajectories of ``prompt_index`` (a slot being generated again), in
        journal order; each position is restored once."""
        return list(self.by_prompt.pop(prompt_index, {}).values())

    def close(self) -> None:
        """Close the files."""
        self._trajs.close()
        self._events.close()
        self._ended.close()

"""The session book of the online gateway: sessions, task groups and their lifetimes. Pure
logic on plain data (the clock is an argument), driven by
:mod:`areal_mega.workflow.online_gateway` on the controller's event loop.

A *slot* is one prompt group the controller has started under its staleness bound (an
``arun_episode`` call waiting for sessions; slots are the controller's group indices, so the
oldest is filled first and delivery in start order is not held up). ``start(task_id)`` joins
the task's open group while it has fewer than ``n_samples`` sessions, else binds a new group of
that task to the oldest free slot; with no free slot it raises :class:`Busy` (HTTP 429: the
staleness bound would be exceeded). A session is *done* when it has ended and has a reward (for
the whole session, or one for every completion), *dropped* when it idles past
``session_timeout_s`` while open, ends without a completion, or ends and gets no reward within
``reward_timeout_s``. A group is *closed* when it has ``n_samples`` sessions or
``group_timeout_s`` (when > 0) passed since it was bound; a closed group whose sessions are all
done or dropped is *ready*: it trains with its done sessions, or, when every one was dropped,
gives its slot back for another task.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

OPEN, ENDED, DONE, DROPPED, TRAINED = "open", "ended", "done", "dropped", "trained"
MAX_TASK_ID = 256
REMEMBER_FINISHED = 100_000  # sessions remembered after training / dropping (clear errors)


class SessionError(ValueError):
    """A request the book refuses; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = status, param


class Busy(SessionError):
    """No group may start now (staleness bound, or the open-session cap); retry later."""

    def __init__(self, message: str, status: int = 429, retry_after_s: float = 1.0):
        super().__init__(message, status)
        self.retry_after_s = retry_after_s


@dataclass
class Session:
    """One agent's session; ``data`` is the gateway's (its recording client)."""

    session_id: str
    task_id: str
    slot: Any
    index: int  # sample index within the group
    last_active: float
    state: str = OPEN
    ended_at: Optional[float] = None
    reward: Optional[float] = None
    completion_rewards: dict = field(default_factory=dict)
    inflight: int = 0
    reason: str = ""  # why it was dropped
    data: Any = None


@dataclass
class Group:
    """The sessions of one task bound to one slot."""

    task_id: str
    slot: Any
    bound_at: float
    sessions: list = field(default_factory=list)
    closed: bool = False


def check_reward(value, max_abs: float, param: str = "reward") -> float:
    """``value`` as a finite float within ``±max_abs``; :class:`SessionError` (400 for a
    non-number, 422 for NaN / inf / out of range) naming ``param`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SessionError(f"{param}: expected a number, got {type(value).__name__}", 400, param)
    v = float(value)
    if not math.isfinite(v):
        raise SessionError(f"{param}: {value!r} is not finite", 422, param)
    if abs(v) > max_abs:
        raise SessionError(
            f"{param}: {v:g} is outside [-{max_abs:g}, {max_abs:g}] "
            "(rollout.online.max_abs_reward)",
            422,
            param,
        )
    return v


def matching_completions(ids, completion_id, session_id: str) -> list:
    """The ids among a session's completion ``ids`` that ``completion_id`` names (a choice id,
    or the id of the response that holds its choices); :class:`SessionError` when none."""
    if not isinstance(completion_id, str):
        raise SessionError("completion_id: expected a string", 400, "completion_id")
    out = [c for c in ids if c == completion_id or c.rsplit("-", 1)[0] == completion_id]
    if not out:
        raise SessionError(
            f"completion_id: session {session_id!r} has no completion {completion_id!r}",
            404,
            "completion_id",
        )
    return out


def fully_rewarded(reward, completion_rewards: dict, ids) -> bool:
    """A session reward, or a reward for each of the session's completions (at least one)."""
    ids = list(ids)
    return reward is not None or bool(ids) and all(c in completion_rewards for c in ids)


class SessionBook:
    """Sessions and groups (see the module doc). ``completion_ids(session)`` returns the ids
    of a session's completions (the gateway's records), to check per-completion rewards."""

    def __init__(
        self,
        n_samples: int,
        session_timeout_s: float,
        reward_timeout_s: float,
        group_timeout_s: float = 0.0,
        max_open_sessions: int = 1024,
        max_abs_reward: float = 1e6,
        completion_ids=lambda s: (),
    ):
        self.n_samples = int(n_samples)
        self.session_timeout_s = float(session_timeout_s)
        self.reward_timeout_s = float(reward_timeout_s)
        self.group_timeout_s = float(group_timeout_s)
        self.max_open_sessions = int(max_open_sessions)
        self.max_abs_reward = float(max_abs_reward)
        self.completion_ids = completion_ids
        self.free_slots: list = []  # oldest first
        self.groups: dict = {}  # slot -> Group
        self.joinable: dict = {}  # task id -> slot of its group taking sessions
        self.sessions: dict = {}  # session id -> Session (live)
        self.finished: OrderedDict = OrderedDict()  # session id -> Session (trained/dropped)
        self.dropped: dict = {}  # reason -> count

    # ------------------------------------------------------------------ slots and sessions
    def add_slot(self, slot) -> None:
        """The controller started a group: sessions of a new task may bind to it."""
        self.free_slots.append(slot)

    def remove_slot(self, slot) -> list:
        """The slot's episode is cancelled (the rollout stops): forget its group; returns the
        sessions that were still live (the caller counts them as dropped)."""
        if slot in self.free_slots:
            self.free_slots.remove(slot)
        g = self.groups.pop(slot, None)
        if g is None:
            return []
        if self.joinable.get(g.task_id) == slot:
            del self.joinable[g.task_id]
        live = [s for s in g.sessions if s.state in (OPEN, ENDED)]
        for s in live:
            self._drop(s, "shutdown")
        return live

    def n_open(self) -> int:
        """Sessions not yet done or dropped."""
        return sum(1 for s in self.sessions.values() if s.state in (OPEN, ENDED))

    def start(self, session_id: str, task_id, now: float) -> Session:
        """Open a session of ``task_id`` (see the module doc). Raises :class:`SessionError`
        for a bad task id, :class:`Busy` when no group can take it."""
        if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_TASK_ID:
            raise SessionError(
                f"task_id: expected a non-empty string of at most {MAX_TASK_ID} characters",
                400,
                "task_id",
            )
        if self.n_open() >= self.max_open_sessions:
            raise Busy(
                f"{self.max_open_sessions} sessions are open "
                "(rollout.online.max_open_sessions); end some first",
                503,
                5.0,
            )
        slot = self.joinable.get(task_id)
        if slot is None:
            if not self.free_slots:
                raise Busy(
                    "no group may start now: the staleness bound "
                    "(rollout.max_head_offpolicyness) would be exceeded until the "
                    "trainer consumes more data; retry later"
                )
            slot = self.free_slots.pop(0)
            self.groups[slot] = Group(task_id, slot, now)
            self.joinable[task_id] = slot
        g = self.groups[slot]
        s = Session(session_id, task_id, slot, len(g.sessions), now)
        g.sessions.append(s)
        self.sessions[session_id] = s
        if len(g.sessions) >= self.n_samples:
            self._close(g)
        return s

    def get(self, session_id, param: str = "session_id") -> Session:
        """The live session ``session_id``; a clear :class:`SessionError` when it is unknown,
        dropped (410) or already trained (409)."""
        if not isinstance(session_id, str):
            raise SessionError(f"{param}: expected a string", 400, param)
        s = self.sessions.get(session_id)
        if s is not None:
            return s
        s = self.finished.get(session_id)
        if s is None:
            raise SessionError(f"{param}: no session {session_id!r}", 404, param)
        if s.state == TRAINED:
            raise SessionError(
                f"session {session_id!r} was already trained on; a reward or "
                "change now would not reach the model",
                409,
                param,
            )
        raise SessionError(f"session {session_id!r} was dropped ({s.reason})", 410, param)

    def touch(self, s: Session, now: float) -> None:
        """A request of ``s`` arrived or finished."""
        s.last_active = now

    def set_reward(self, s: Session, reward, completion_id=None, now: float = 0.0) -> None:
        """Record ``reward`` for the whole session or for one completion (its id, or the id of
        the response that holds it)."""
        v = check_reward(reward, self.max_abs_reward)
        if s.state in (DROPPED, TRAINED):
            self.get(s.session_id)  # raises the clear error
        if completion_id is None:
            s.reward = v
        else:
            for c in matching_completions(self.completion_ids(s), completion_id, s.session_id):
                s.completion_rewards[c] = v
        s.last_active = now
        self._settle(s)

    def end(self, s: Session, now: float) -> None:
        """The agent is done with ``s``: no more completions; it is done once it has its
        reward (which may come later, within ``reward_timeout_s``)."""
        if s.state != OPEN:
            return
        if s.inflight:
            raise SessionError(
                f"session {s.session_id!r} has a completion in flight; end it after the answer", 409
            )
        if not list(self.completion_ids(s)):
            self._drop(s, "no_completions")  # nothing to train on
            return
        s.state, s.ended_at = ENDED, now
        self._settle(s)

    def has_reward(self, s: Session) -> bool:
        """A session reward, or a reward for each of its completions (at least one)."""
        return fully_rewarded(s.reward, s.completion_rewards, self.completion_ids(s))

    def _settle(self, s: Session) -> None:
        if s.state == ENDED and self.has_reward(s):
            s.state = DONE

    def _close(self, g: Group) -> None:
        g.closed = True
        if self.joinable.get(g.task_id) == g.slot:
            del self.joinable[g.task_id]

    def _drop(self, s: Session, reason: str) -> None:
        s.state, s.reason = DROPPED, reason
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self._forget(s)

    def remember(self, s: Session) -> None:
        """Keep ``s`` (trained or dropped elsewhere, e.g. restored after a restart) among the
        finished sessions, so that a later request about it gets its clear 409 / 410."""
        self._forget(s)

    def _forget(self, s: Session) -> None:
        s.data = None  # its records: only the state is kept, for clear errors
        self.sessions.pop(s.session_id, None)
        self.finished[s.session_id] = s
        while len(self.finished) > REMEMBER_FINISHED:
            self.finished.popitem(last=False)

    # ------------------------------------------------------------------ the clock
    def tick(self, now: float) -> tuple:
        """Apply the timeouts at time ``now``. Returns ``(dropped, ready)``: the sessions
        dropped now (``reason`` set: ``idle`` | ``no_reward``) and the ready groups, which
        leave the book: a group with done sessions is to be trained (then call
        :meth:`trained`), an all-dropped one has given its slot back (oldest first)."""
        dropped = []
        for s in list(self.sessions.values()):
            if s.state == OPEN and s.inflight == 0 and now - s.last_active > self.session_timeout_s:
                self._drop(s, "idle")
                dropped.append(s)
            elif s.state == ENDED and now - s.ended_at > self.reward_timeout_s:
                self._drop(s, "no_reward")
                dropped.append(s)
        ready = []
        for slot, g in list(self.groups.items()):
            if (
                not g.closed
                and self.group_timeout_s > 0
                and now - g.bound_at >= self.group_timeout_s
            ):
                self._close(g)
            if not g.closed and g.sessions and all(s.state == DROPPED for s in g.sessions):
                self._close(g)  # nobody left in it: give the slot to another task
            if g.closed and all(s.state in (DONE, DROPPED) for s in g.sessions):
                del self.groups[slot]
                if any(s.state == DONE for s in g.sessions):
                    ready.append(g)
                else:
                    bisect.insort(self.free_slots, slot)
        return dropped, ready

    def trained(self, g: Group) -> None:
        """``g``'s done sessions were delivered for training: a later reward is refused."""
        for s in g.sessions:
            if s.state == DONE:
                s.state = TRAINED
                self._forget(s)

"""The rollout side's counters travel to the trainer with the trajectories.

The rollout worker counts events that produce no trajectory: failed and dropped episodes (by
reason), retries, interruptions, reward errors, the external agents' outcomes
(``agent_ok``, ``agent_failed/<reason>``), sandbox kills and timeouts, gateway sessions. When it
delivers a group, :class:`CountCarrier` puts what changed since its previous delivery into the
group's first trajectory (``meta["rollout_counts"]``); the trainer sums the carried counts of
the groups each step consumes (:func:`carried_counts`) into the step's ``rollout/<name>``
metrics. So each event is counted once: it rides on exactly one journaled group, a resumed
trainer redoes a step with the same groups (and ``metrics.jsonl`` is cut back to the
checkpoint), a duplicate delivery is dropped with its group by the buffer, and a relaunched
worker carries only what its own process counted. Events after a worker's last delivery die
with the worker.

A group the trainer never journaled (in flight when the trainer or the worker died) is
generated or delivered again, and so are its counts: the worker keeps, in its saved state, the
counts each recent delivery carried (``in_flight``); when it resumes from the trainer's
ledger, the counts of the deliveries the ledger lacks ride on its next delivered group
(:meth:`CountCarrier.carry_again_unless`). Deliveries older than the newest
``IN_FLIGHT_KEPT`` groups were acknowledged and journaled long before (a sender keeps at most
``dataplane.sender_window`` trajectories unacknowledged).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Sequence

from areal_mega.common import counters

CARRY_KEY = "rollout_counts"
PREFIX = "rollout/"
# controller.stats() keys that are cumulative event counts (the others are gauges)
CONTROLLER_COUNTS = ("failed", "retries", "dropped_prompts", "interruptions", "reward_errors")


def counts_of(stats: dict) -> dict:
    """The cumulative event counters in a controller's ``stats()`` (workflow counters such as
    ``agent_ok`` / ``agent_failed/<reason>`` and ``dropped/<reason>`` included) plus the
    process-wide ones of :mod:`areal_mega.common.counters`."""
    out = {k: int(stats[k]) for k in CONTROLLER_COUNTS if k in stats}
    out.update(
        {
            k: int(v)
            for k, v in stats.items()
            if k.startswith(("agent_", "dropped/")) and isinstance(v, (int, float))
        }
    )
    out.update(counters.snapshot())
    return out


IN_FLIGHT_KEPT = 256
"""Recent deliveries whose carried counts the worker keeps until the trainer's ledger shows
them journaled."""


def _add(into: dict, counts: dict) -> dict:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + int(v)
    return into


class CountCarrier:
    """Worker side: the counters delivered so far (``delivered``, the worker's own cumulative
    counts; ``start`` continues them after a relaunch), the deltas to attach, and what recent
    deliveries carried (``in_flight``: ``[prompt position, carrier sample id, counts]``) or
    must carry again (``again``), both continued from the saved :meth:`state`."""

    def __init__(
        self,
        read: Callable[[], dict],
        start: Optional[dict] = None,
        in_flight: Optional[list] = None,
        again: Optional[dict] = None,
    ):
        self.read = read  # the process's cumulative counts now
        self.delivered = {k: int(v) for k, v in (start or {}).items()}
        self.in_flight: deque = deque(
            ([int(p), str(s), dict(c)] for p, s, c in in_flight or []), maxlen=IN_FLIGHT_KEPT
        )
        self.again = {k: int(v) for k, v in (again or {}).items()}
        self._base: dict = {}  # what this process had counted at the last delivery

    @classmethod
    def from_state(cls, read: Callable[[], dict], state: dict) -> "CountCarrier":
        """The carrier continuing a saved :meth:`state` (a relaunch or resume)."""
        return cls(
            read,
            start=state.get("counts"),
            in_flight=state.get("counts_in_flight"),
            again=state.get("counts_again"),
        )

    def state(self) -> dict:
        """Plain data for the worker's saved state (JSON-safe)."""
        return {
            "counts": self.delivered,
            "counts_in_flight": list(self.in_flight),
            "counts_again": self.again,
        }

    def attach(self, group: list) -> dict:
        """Put the counts since the previous delivery, plus any to carry again, into
        ``group[0].meta`` (only non-zero ones; nothing when none changed) and return them.
        Call once per delivered group, under the delivery lock."""
        if not group:
            return {}
        now = self.read()
        delta = {k: v - self._base.get(k, 0) for k, v in now.items() if v != self._base.get(k, 0)}
        self._base = now
        _add(self.delivered, delta)
        carried = _add(dict(delta), self.again)
        self.again = {}
        if carried:
            group[0].meta[CARRY_KEY] = carried
            prompt = group[0].meta.get("prompt_index")
            if prompt is not None:
                self.in_flight.append([int(prompt), group[0].sample_id, carried])
        return carried

    def carry_again_unless(self, journaled: Callable[[int, str], bool]) -> dict:
        """Resuming: the counts of the recent deliveries for which ``journaled(prompt,
        sample_id)`` is false (the trainer never journaled them) are carried again by the
        next delivered group; returns them."""
        for prompt, sample_id, counts in self.in_flight:
            if not journaled(prompt, sample_id):
                _add(self.again, counts)
        self.in_flight.clear()
        return dict(self.again)


def carried_counts(trajs: Sequence) -> dict:
    """Trainer side: ``{"rollout/<name>": sum}`` over the counts the trajectories carry (one
    step's groups), as floats; empty when none carry any."""
    out: dict = {}
    for t in trajs:
        for k, v in (t.meta.get(CARRY_KEY) or {}).items():
            out[PREFIX + k] = out.get(PREFIX + k, 0.0) + float(v)
    return out

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
"""

from __future__ import annotations

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


class CountCarrier:
    """Worker side: the counters delivered so far (``delivered``, the worker's own cumulative
    counts; ``start`` continues them after a relaunch) and the deltas to attach."""

    def __init__(self, read: Callable[[], dict], start: Optional[dict] = None):
        self.read = read  # the process's cumulative counts now
        self.delivered = {k: int(v) for k, v in (start or {}).items()}
        self._base: dict = {}  # what this process had counted at the last delivery

    def attach(self, group: list) -> dict:
        """Put the counts since the previous delivery into ``group[0].meta`` (only non-zero
        ones; nothing when none changed) and return them. Call once per delivered group,
        under the delivery lock."""
        if not group:
            return {}
        now = self.read()
        delta = {k: v - self._base.get(k, 0) for k, v in now.items() if v != self._base.get(k, 0)}
        self._base = now
        if delta:
            group[0].meta[CARRY_KEY] = delta
            for k, v in delta.items():
                self.delivered[k] = self.delivered.get(k, 0) + v
        return delta


def carried_counts(trajs: Sequence) -> dict:
    """Trainer side: ``{"rollout/<name>": sum}`` over the counts the trajectories carry (one
    step's groups), as floats; empty when none carry any."""
    out: dict = {}
    for t in trajs:
        for k, v in (t.meta.get(CARRY_KEY) or {}).items():
            out[PREFIX + k] = out.get(PREFIX + k, 0.0) + float(v)
    return out

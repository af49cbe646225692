"""Which prompts the trainer has durably accepted, and where a resumed rollout starts.

A rollout group's size is its number of trajectories (``meta["group_size"]``: agents can fail,
an episode can yield several samples), so accepted samples divided by ``rollout.n_samples``
does not say how many prompts were accepted, nor which. The trainer's intake therefore keeps a
:class:`PromptLedger` of the prompt positions (``meta["prompt_index"]``) whose whole group it
has journaled; each checkpoint stores the ledger (``extra["accepted_prompts"]``) and the
journal segments since replay into it. On resume the rollout worker regenerates exactly the
drawn prompts the ledger lacks (:func:`resume_plan`): none is lost (a group in flight or cut
short by the crash is generated again) and none repeated (a group journaled after the
rollout's own saved position is not generated again). Pure logic on plain data.
"""

from __future__ import annotations

from typing import Iterable, Optional


def _add_interval(intervals: list, k: int) -> None:
    """Insert ``k`` into sorted disjoint half-open ``[a, b)`` intervals, merging neighbours."""
    for i, (a, b) in enumerate(intervals):
        if a <= k < b:
            return
        if k == b:
            intervals[i][1] = b + 1
            if i + 1 < len(intervals) and intervals[i + 1][0] == b + 1:
                intervals[i][1] = intervals.pop(i + 1)[1]
            return
        if k == a - 1:
            intervals[i][0] = k
            return
        if k < a:
            intervals.insert(i, [k, k + 1])
            return
    intervals.append([k, k + 1])


class PromptLedger:
    """Prompt positions whose complete group was accepted (``done``, as sorted half-open
    intervals) and the groups seen only in part (``partial``: group id -> prompt position,
    group size, sample ids seen). Samples without a ``prompt_index`` are ignored."""

    def __init__(self, state: Optional[dict] = None):
        state = state or {}
        self.done = [list(map(int, iv)) for iv in state.get("done", [])]
        self.partial = {
            g: {"prompt": int(p["prompt"]), "size": int(p["size"]), "samples": list(p["samples"])}
            for g, p in state.get("partial", {}).items()
        }

    def add(self, traj) -> None:
        """Count one accepted trajectory (a repeated sample id is counted once)."""
        meta = traj.meta
        if "prompt_index" not in meta:
            return
        k = int(meta["prompt_index"])
        size = int(meta.get("group_size", 1))
        entry = self.partial.setdefault(traj.group_id, {"prompt": k, "size": size, "samples": []})
        if traj.sample_id not in entry["samples"]:
            entry["samples"].append(traj.sample_id)
        if len(entry["samples"]) >= entry["size"]:
            del self.partial[traj.group_id]
            _add_interval(self.done, k)

    def accepted_prompts(self) -> set:
        """Every prompt position whose whole group was accepted."""
        return {k for a, b in self.done for k in range(a, b)}

    def holds(self, prompt: int, sample_id: str) -> bool:
        """Whether sample ``sample_id`` of prompt position ``prompt`` was accepted: its whole
        group was, or the sample is among a partial group's."""
        if any(a <= prompt < b for a, b in self.done):
            return True
        return any(
            p["prompt"] == prompt and sample_id in p["samples"] for p in self.partial.values()
        )

    def n_accepted_groups(self) -> int:
        """How many groups were accepted whole."""
        return sum(b - a for a, b in self.done)

    def state(self) -> dict:
        """Plain data for a checkpoint's metadata (JSON-safe)."""
        return {
            "done": [list(iv) for iv in self.done],
            "partial": {g: dict(p, samples=list(p["samples"])) for g, p in self.partial.items()},
        }

    @classmethod
    def replayed(cls, state: Optional[dict], trajs: Iterable) -> "PromptLedger":
        """The ledger of a checkpoint (``state``) with the journal since (``trajs``) added."""
        ledger = cls(state)
        for t in trajs:
            ledger.add(t)
        return ledger


def resume_plan(accepted: set, drawn: int) -> tuple:
    """Where a resumed rollout starts: ``(redo, start)`` — the prompt positions below
    ``start`` that were drawn but are not in ``accepted`` (in order; generated first), and the
    first never-drawn position. ``drawn``: how many prompts the rollout had drawn (its saved
    state; positions the trainer accepted beyond it count as drawn too)."""
    if drawn < 0:
        raise ValueError(f"drawn={drawn} must be >= 0")
    start = max([drawn] + [k + 1 for k in accepted])
    return [k for k in range(start) if k not in accepted], start

"""Staleness accounting (pure; no torch, no I/O).

Units: **prompt groups** throughout. ``batch_size`` is the number of prompt groups the trainer
consumes per step; ``accepted`` counts groups that finished and were handed to the trainer's
buffer (minus any the trainer later reported rejected), ``running`` counts groups started and
not yet finished. A new group may start only while

    accepted + running < (eta + version + 1) * batch_size

so the g-th accepted group (0-based, in start order) was started at a version w with
g < (eta + w + 1) * batch_size. A trainer that consumes groups in start order trains on group g
at version floor(g / batch_size) <= eta + w: no consumed sample is more than ``eta`` versions
older than the trainer (the sample's version is the version its first token was generated with).
"""

from __future__ import annotations

from dataclasses import dataclass


def rollout_capacity(version: int, accepted: int, running: int, batch_size: int, eta: int) -> int:
    """How many more prompt groups may start now (never negative)."""
    if batch_size < 1 or eta < 0 or version < 0 or accepted < 0 or running < 0:
        raise ValueError(
            f"rollout_capacity: invalid arguments version={version} "
            f"accepted={accepted} running={running} batch_size={batch_size} "
            f"eta={eta}"
        )
    return max(0, (eta + version + 1) * batch_size - (accepted + running))


def may_start(version: int, accepted: int, running: int, batch_size: int, eta: int) -> bool:
    """Whether one more prompt group may start under the bound."""
    return rollout_capacity(version, accepted, running, batch_size, eta) > 0


def sample_version(token_versions) -> int:
    """A sample's version: the oldest weight version among its generated tokens (-1 ignored);
    -1 if it has no generated token."""
    vs = [int(v) for v in token_versions if int(v) >= 0]
    return min(vs) if vs else -1


def staleness(trainer_version: int, token_versions) -> int:
    """``trainer_version - sample_version``: 0 for an on-policy sample."""
    v = sample_version(token_versions)
    return trainer_version - v if v >= 0 else 0


@dataclass
class StalenessCounter:
    """The counters behind the bound (not thread-safe; the controller owns one per loop)."""

    batch_size: int
    eta: int
    version: int = 0
    accepted: int = 0
    running: int = 0
    rejected: int = 0

    def capacity(self) -> int:
        """Groups that may start now."""
        return rollout_capacity(
            self.version, self.accepted, self.running, self.batch_size, self.eta
        )

    def on_start(self) -> None:
        """A group started; raises if that breaks the bound."""
        if self.capacity() <= 0:
            raise RuntimeError("staleness bound violated: no capacity to start a group")
        self.running += 1

    def on_finish(self, accepted: bool = True) -> None:
        """A group finished; ``accepted=False`` when it was filtered out (frees its slot)."""
        if self.running <= 0:
            raise RuntimeError("on_finish without a running group")
        self.running -= 1
        if accepted:
            self.accepted += 1
        else:
            self.rejected += 1

    def on_rejected(self, n: int = 1) -> None:
        """The trainer dropped ``n`` accepted groups (e.g. dynamic filtering)."""
        n = min(n, self.accepted)
        self.accepted -= n
        self.rejected += n

    def set_version(self, version: int) -> None:
        """The trainer's weights of ``version`` are now on the servers."""
        if version < self.version:
            raise ValueError(f"version went backwards: {self.version} -> {version}")
        self.version = version

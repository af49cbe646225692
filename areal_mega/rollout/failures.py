"""What happens to a prompt (task) whose episode failed, and when failures end the run.

A failed episode is retried up to ``max_episode_retries`` attempts (at once given up when a
server rejected its request: it would fail again). A prompt out of attempts is then, by
``rollout.on_episode_failure``:

- ``fail``: the run fails with that episode's error;
- ``drop``: the prompt is dropped, counted (``dropped_prompts``, ``dropped/<reason>``) and the
  run goes on;
- ``auto`` (default): ``fail`` for the built-in workflows (``rlvr``, ``multi_turn``: a failure
  there is a bug or a broken server), ``drop`` for every other one (external agents, episode
  functions, the online gateway: an agent may fail on some tasks).

Dropping is bounded by a failure-rate ceiling (:class:`FailureRate`): over the final outcomes
of the last ``rollout.failure_window`` prompts (delivered or dropped; a retry is not an
outcome, so the rate does not depend on the retry budget), once at least
``rollout.failure_min_prompts`` are in, a dropped share above ``rollout.failure_rate_ceiling``
stops the run with one :class:`FailureRateExceeded` naming the rate, the window and these keys
(``failure_rate_ceiling=1`` never stops). A relaunch does not cure it: the rollout worker exits
with :data:`areal_mega.run_dir.FATAL_EXIT_CODE` and ``launch.local`` ends the run.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Optional

from areal_mega.rollout.client import RolloutRequestError

BUILTIN_WORKFLOWS = ("rlvr", "multi_turn")
KEYS = ("rollout.failure_rate_ceiling", "rollout.failure_window", "rollout.failure_min_prompts")


class FailureRateExceeded(RuntimeError):
    """Too many of the recent prompts failed; no relaunch cures it."""


def episode_failure_policy(on_episode_failure: str, workflow: str) -> str:
    """``fail`` or ``drop``: what ``rollout.on_episode_failure`` means for ``rollout.workflow``
    (``auto``: ``fail`` for the built-in workflows, ``drop`` for the others)."""
    if on_episode_failure not in ("auto", "fail", "drop"):
        raise ValueError(f"on_episode_failure={on_episode_failure!r}: must be auto, fail or drop")
    if on_episode_failure != "auto":
        return on_episode_failure
    return "fail" if workflow in BUILTIN_WORKFLOWS else "drop"


class FailureRate:
    """The final outcomes (ok, or failed with a reason) of the last ``window`` prompts, and
    whether the failed share passed ``ceiling`` (checked once ``min_prompts`` are in).
    Thread-safe."""

    def __init__(self, ceiling: float = 0.5, window: int = 64, min_prompts: int = 16):
        if not 0.0 <= ceiling <= 1.0:
            raise ValueError(f"failure_rate_ceiling={ceiling!r}: must be in [0, 1]")
        if not 1 <= min_prompts <= window:
            raise ValueError(
                f"failure_min_prompts={min_prompts!r}: must be in [1, failure_window={window}]"
            )
        self.ceiling, self.window, self.min_prompts = float(ceiling), int(window), min_prompts
        self._outcomes: deque = deque(maxlen=self.window)  # None (ok) or the failure reason
        self._lock = threading.Lock()

    def record(self, ok: bool, reason: str = "", detail: str = "") -> Optional[FailureRateExceeded]:
        """Add one prompt's final outcome; return the error to stop the run with when the
        failed share of the window now passes the ceiling, else None. ``detail``: the failure's
        own message, quoted in that error."""
        with self._lock:
            self._outcomes.append(None if ok else (reason or "failed"))
            n = len(self._outcomes)
            by_reason = Counter(r for r in self._outcomes if r is not None)
        failed = sum(by_reason.values())
        if ok or n < self.min_prompts or failed / n <= self.ceiling:
            return None
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(by_reason.items()))
        last = f"; the last: {detail[:300]}" if detail else ""
        return FailureRateExceeded(
            f"{failed} of the last {n} prompts failed (rate {failed / n:.2f} > "
            f"rollout.failure_rate_ceiling={self.ceiling:g}, window rollout.failure_window="
            f"{self.window} prompts, checked from rollout.failure_min_prompts="
            f"{self.min_prompts}; by reason: {reasons}){last}. Too many tasks fail: fix the "
            f"agent or workflow (the rollout worker's log says why each failed), or raise "
            f"rollout.failure_rate_ceiling (1 never stops)"
        )

    def rate(self) -> float:
        """The failed share of the outcomes in the window (0 when there are none)."""
        with self._lock:
            n = len(self._outcomes)
            return sum(r is not None for r in self._outcomes) / n if n else 0.0


class EpisodeFailures:
    """The controller's bookkeeping of failed episodes: whether to retry a prompt, drop it or
    fail the run (see the module doc), with the counts for its ``stats()``."""

    def __init__(
        self, policy: str = "fail", max_retries: int = 3, rate: Optional[FailureRate] = None
    ):
        if policy not in ("fail", "drop"):
            raise ValueError(f"on_episode_failure={policy!r}: must be fail or drop")
        self.policy, self.max_retries = policy, max_retries
        self.rate = rate or FailureRate()
        self._lock = threading.Lock()
        self.n_retries = 0  # failed episodes started again
        self.n_dropped = 0  # prompts given up (drop)
        self.dropped_by_reason: Counter = Counter()  # rejected | out_of_retries | ...

    def after_failure(self, attempt: int, e: BaseException) -> tuple:
        """A prompt's episode failed on attempt ``attempt`` (0-based) with ``e``: returns
        ``(retry, error)``: requeue the prompt, and the error that ends the run (None: go on;
        a dropped prompt is counted and recorded here)."""
        if not _retryable(e):
            msg = (
                f"episode failed: the server rejected the request, which would fail "
                f"again, so it is not retried: {e}"
            )
            return False, self._give_up(msg, e, "rejected")
        if attempt + 1 < self.max_retries:
            with self._lock:
                self.n_retries += 1
            return True, None
        return False, self._give_up(f"episode failed {attempt + 1} times: {e}", e, "out_of_retries")

    def _give_up(self, msg: str, cause: BaseException, reason: str) -> Optional[BaseException]:
        if self.policy == "drop":
            return self.record_outcome(False, reason, msg)
        err = RuntimeError(msg)
        err.__cause__ = cause
        return err

    def record_outcome(
        self, ok: bool, reason: str = "", detail: str = ""
    ) -> Optional[RuntimeError]:
        """One prompt's final outcome: delivered (``ok``) or given up for ``reason``
        (``detail``: its error). Under ``drop`` a failure is counted as ``dropped/<reason>``
        and the :class:`FailureRateExceeded` to stop the run with is returned once the window
        passes the ceiling; under ``fail`` any failure is the error that ends the run. None:
        go on."""
        if not ok and self.policy == "fail":
            return RuntimeError(f"task failed ({reason or 'failed'}): {detail}")
        if not ok:
            with self._lock:
                self.n_dropped += 1
                self.dropped_by_reason[reason or "failed"] += 1
        return self.rate.record(ok, reason, detail)

    def stats(self) -> dict:
        """``retries``, ``dropped_prompts``, ``dropped/<reason>`` and the window's
        ``failure_rate``."""
        with self._lock:
            return {
                "dropped_prompts": self.n_dropped,
                "retries": self.n_retries,
                **{f"dropped/{k}": v for k, v in sorted(self.dropped_by_reason.items())},
                "failure_rate": self.rate.rate(),
            }


def _retryable(e: BaseException) -> bool:
    """Whether an episode that failed with ``e`` may succeed on a retry: not when a server
    rejected its request (HTTP 4xx, :class:`RolloutRequestError`: a bad request fails again),
    except 408 (timeout) and 429 (too many requests) when the error carries its status."""
    if isinstance(e, RolloutRequestError):
        return getattr(e, "status", None) in (408, 429)
    return True

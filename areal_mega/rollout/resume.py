"""Exact resume of the rollout worker's prompt stream (see
:mod:`areal_mega.dataplane.prompt_ledger`).

The trainer's checkpoint names the prompts whose whole group it holds (``accepted_prompts``) and
its journal the groups accepted since; :func:`resumed_cursor` rebuilds the prompt stream so that
the drawn prompts missing from both are generated again first and drawing goes on after the
last drawn one. A checkpoint written before the ledger existed has none: the caller then keeps
the saved position (``next_prompt``).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional

from areal_mega.dataplane.prompt_ledger import PromptLedger, resume_plan
from areal_mega.run_dir import RunDir, checkpoint_meta


class ResumingCursor:
    """A prompt cursor that first yields the items of ``redo`` (prompt positions, each rebuilt
    by ``make_cursor(k)``) and then those of ``make_cursor(start)``. Same interface as the
    worker's cursors: iterate for items, :meth:`delivered` for the oldest undelivered position,
    ``drawn`` for the next never-drawn one."""

    def __init__(self, make_cursor: Callable, redo: list, start: int):
        self._make = make_cursor
        self._redo = deque(redo)
        self.main = make_cursor(start)
        self.outstanding: set = set()
        self._lock = threading.Lock()

    @property
    def drawn(self) -> int:
        """The first prompt position never drawn."""
        return self.main.drawn

    def __iter__(self):
        while True:
            with self._lock:
                k = self._redo.popleft() if self._redo else None
                if k is not None:
                    self.outstanding.add(k)
            if k is None:
                break
            yield next(iter(self._make(k)))
        yield from self.main

    def delivered(self, k: int) -> int:
        """Mark prompt ``k`` delivered; returns the oldest outstanding position."""
        nxt = self.main.delivered(k)
        with self._lock:
            self.outstanding.discard(k)
            return min(self.outstanding | set(self._redo) | {nxt})


def accepted_ledger(paths: RunDir, ckpt) -> Optional[PromptLedger]:
    """The prompts the trainer holds whole: checkpoint ``ckpt``'s ledger plus the journal
    segments written since it (:meth:`RunDir.journal_since`); None when ``ckpt`` predates the
    ledger."""
    state = checkpoint_meta(ckpt).get("extra", {}).get("accepted_prompts")
    if state is None:
        return None
    return PromptLedger.replayed(state, paths.journal_since(ckpt))


def resumed_cursor(make_cursor: Callable, ledger: PromptLedger, drawn: int) -> tuple:
    """``(cursor, redo)``: a :class:`ResumingCursor` regenerating the drawn prompts ``ledger``
    lacks, and their positions."""
    redo, start = resume_plan(ledger.accepted_prompts(), drawn)
    return ResumingCursor(make_cursor, redo, start), redo

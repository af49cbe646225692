"""Multi-task prompts: several sources (``data.sources``) drawn by weight, resumably.

    specs = resolve_sources(cfg.data, cfg.rollout.reward_fn)   # data.train_path = one source
    cursor = MultiSourceCursor([PromptDataset(...) for s in specs], specs, seed, start=k)
    for item in cursor: ...          # item["source"] names the source; item["prompt_index"] = k

The rollout worker's only resume state is ``k``, the global position of the oldest prompt not
yet delivered (``rollout_state.json``). So everything here is a pure function of
``(seed, weights, k)``: the source of draw ``k`` comes from a block of 1024 draws sampled with
``numpy.random.default_rng([seed, SCHEDULE_SALT, block])`` (:func:`source_schedule`), and a
source's own position is the number of earlier draws that picked it (:func:`source_counts`),
walked through that source's own epoch shuffles. A resumed cursor yields exactly the items an
uninterrupted one would have from ``k`` on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from areal_mega.data.dataset import DataError, PromptSampler, field_keys

BLOCK = 1024
SCHEDULE_SALT = 0x5EED


@dataclass(frozen=True)
class SourceSpec:
    """One resolved source (plain data: what the worker needs to load and score it)."""

    name: str
    path: str
    weight: float = 1.0
    reward_fn: str = ""
    reward_kwargs: dict = field(default_factory=dict)
    prompt_key: str = "prompt"
    answer_key: str = "answer"


def check_sources(data_cfg) -> None:
    """Config rules for ``data.sources`` / ``data.train_path``; raises ``DataError`` (a
    ``ValueError``) naming the key, e.g. ``data.sources[1].name``."""
    if data_cfg.sources and data_cfg.train_path:
        raise DataError(
            "data.train_path and data.sources are both set: train_path is the "
            "shorthand for one source; list it under data.sources instead"
        )
    seen: dict = {}
    for i, src in enumerate(data_cfg.sources):
        key = f"data.sources[{i}]"
        if not src.name or "/" in src.name:
            raise DataError(
                f"{key}.name={src.name!r}: needs a non-empty name without '/' "
                "(its metric is reward/<name>)"
            )
        if src.name in ("mean", "std"):
            raise DataError(
                f"{key}.name={src.name!r}: reserved (reward/{src.name} is the overall statistic)"
            )
        if src.name in seen:
            raise DataError(
                f"{key}.name={src.name!r}: already used by data.sources[{seen[src.name]}]"
            )
        seen[src.name] = i
        if not src.path:
            raise DataError(
                f"{key}.path is empty: a file, a saved HF dataset directory or hf:owner/name"
            )
        field_keys(data_cfg, src.fields, f"{key}.fields")
    field_keys(data_cfg, {})


def resolve_sources(data_cfg, default_reward_fn: str) -> list[SourceSpec]:
    """The run's sources: ``data.sources``, or ``data.train_path`` as one source ``train``."""
    check_sources(data_cfg)
    if not data_cfg.sources:
        if not data_cfg.train_path:
            raise DataError(
                "data.train_path is empty and data.sources is empty: give the training prompts"
            )
        p, a = field_keys(data_cfg, {})
        return [SourceSpec("train", data_cfg.train_path, 1.0, default_reward_fn, {}, p, a)]
    out = []
    for i, s in enumerate(data_cfg.sources):
        p, a = field_keys(data_cfg, s.fields, f"data.sources[{i}].fields")
        out.append(
            SourceSpec(
                s.name,
                s.path,
                float(s.weight),
                s.reward_fn or default_reward_fn,
                dict(s.reward_kwargs),
                p,
                a,
            )
        )
    return out


def _probabilities(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or (w <= 0).any() or not np.isfinite(w).all():
        raise DataError(f"source weights {list(weights)}: need one or more finite weights > 0")
    return w / w.sum()


def _block(probs: np.ndarray, seed: int, b: int) -> np.ndarray:
    rng = np.random.default_rng([int(seed), SCHEDULE_SALT, int(b)])
    return rng.choice(len(probs), size=BLOCK, p=probs)


def source_schedule(weights: Sequence[float], seed: int, start: int, count: int) -> list[int]:
    """Source indices of draws ``start .. start+count-1`` (a pure function of its arguments)."""
    probs = _probabilities(weights)
    out: list[int] = []
    k = start
    while len(out) < count:
        b, off = divmod(k, BLOCK)
        take = min(BLOCK - off, count - len(out))
        out += [int(x) for x in _block(probs, seed, b)[off : off + take]]
        k += take
    return out


def source_counts(weights: Sequence[float], seed: int, k: int) -> list[int]:
    """How many of the draws ``0 .. k-1`` picked each source."""
    probs = _probabilities(weights)
    counts = np.zeros(len(probs), dtype=np.int64)
    full, rest = divmod(int(k), BLOCK)
    for b in range(full):
        counts += np.bincount(_block(probs, seed, b), minlength=len(probs))
    if rest:
        counts += np.bincount(_block(probs, seed, full)[:rest], minlength=len(probs))
    return [int(c) for c in counts]


class MultiSourceCursor:
    """Endless prompt items from several datasets, drawn by weight, resumable at any global
    position ``start`` (see the module doc). Same interface as the worker's single-source
    cursor: iterate for items, :meth:`delivered` for the resume position."""

    def __init__(
        self,
        datasets: Sequence,
        specs: Sequence[SourceSpec],
        seed: int,
        shuffle: bool = True,
        start: int = 0,
    ):
        if len(datasets) != len(specs) or not specs:
            raise DataError("MultiSourceCursor: one dataset per source, at least one")
        self.datasets, self.specs, self.seed = list(datasets), list(specs), int(seed)
        self.shuffle = shuffle
        self.weights = [s.weight for s in specs]
        self.samplers = []
        counts = source_counts(self.weights, seed, start)
        for i, (ds, c) in enumerate(zip(self.datasets, counts)):
            n = len(ds)
            sampler = PromptSampler(
                n, 1, seed=self.seed * 1000 + i, shuffle=shuffle, drop_last=False
            )
            if c:
                sampler.load_state_dict({"epoch": c // n, "offset": c % n})
            self.samplers.append(sampler)
        self.drawn = self.delivered_upto = int(start)
        self.outstanding: set = set()
        self._lock = threading.Lock()
        self._pending: list[int] = []

    def _next_source(self) -> int:
        if not self._pending:
            self._pending = source_schedule(self.weights, self.seed, self.drawn, BLOCK)[::-1]
        return self._pending.pop()

    def next_item(self) -> dict:
        """The item of draw ``self.drawn`` (then moves on)."""
        with self._lock:
            k = self.drawn
            s = self._next_source()
            idx = self.samplers[s].next_indices()[0]
            self.drawn += 1
            self.outstanding.add(k)
        # a record's own "source" field gives way to the source's name
        return {
            **self.datasets[s].prompt_fields(idx),
            "prompt_index": k,
            "source": self.specs[s].name,
        }

    def __iter__(self):
        while True:
            yield self.next_item()

    def delivered(self, k: int) -> int:
        """Mark prompt ``k`` delivered; returns the resume position (oldest outstanding)."""
        with self._lock:
            self.outstanding.discard(k)
            return min(self.outstanding) if self.outstanding else self.drawn

    def at(self, start: int) -> "MultiSourceCursor":
        """The same draws from global position ``start``."""
        return MultiSourceCursor(self.datasets, self.specs, self.seed, self.shuffle, start)

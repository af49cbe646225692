"""Micro-batch planning: pure functions on sequence lengths (no torch, no torch.distributed).

``plan_micro_batches`` returns ``plan[rank][mb] -> list of sample indices``:

1. **DP balance**: Karmarkar-Karp (largest differencing, k-way) splits the sequences into
   ``dp_size`` sets of near-equal cost, then a swap/move pass shrinks the largest set. Cost is
   the token count (``balance_by="tokens"``) or estimated FLOPs ``a*L + L**2``
   (``balance_by="flops"``, ``a = flops_linear_coef`` ~ 12 x hidden size: dense matmuls
   against causal attention).
2. **Micro-batches**: every rank gets the same number ``m`` of micro-batches, the fewest
   that every rank's sequences fit into under ``max_tokens_per_mb``: counts are tried upward
   from ``ceil(rank tokens / budget)`` (and the count of sequences over half the budget), at
   least ``min_micro_batches``, in steps of ``pp_size``; a count is feasible when a bounded
   exact bin-packing search (longest first, lightest bin first) or FFD fits every rank. The
   FFD count is the upper end (always feasible), so ``m`` never exceeds it. Each rank is then
   split into ``m`` token-balanced micro-batches by KK, or, if that breaks the budget, the
   search's packing balanced by a move/swap pass.
3. **Empty micro-batches**: when a rank has fewer sequences than ``m`` (few sequences, many
   ranks), it gets empty micro-batches ``[]``. They sit at the end of the rank's list; the
   engine packs them to a padding-only batch (``pack_sequences([])``) so every rank runs the
   same number of forward/backward passes and collectives.
4. **Order**: micro-batches are ordered small-large-small ("pyramid") by cost, so the
   pipeline fill (first micro-batch) and drain (last) bubbles are as short as possible and
   neighbouring micro-batches are of similar size.

Deterministic: the same input gives the same plan (ties broken by index).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence


class PlanError(ValueError):
    """Impossible or malformed planning input; the message names the offending sequence."""


def sequence_costs(
    seqlens: Sequence[int], balance_by: str = "tokens", flops_linear_coef: float = 49152.0
) -> list[float]:
    """Per-sequence cost used for DP balancing: ``L`` or ``a*L + L**2``."""
    if balance_by == "tokens":
        return [float(n) for n in seqlens]
    if balance_by == "flops":
        return [flops_linear_coef * n + float(n) * n for n in seqlens]
    raise PlanError(f"balance_by={balance_by!r}: must be 'tokens' or 'flops'")


def karmarkar_karp(costs: Sequence[float], k: int) -> list[list[int]]:
    """Split indices of ``costs`` into ``k`` sets of near-equal sum (largest differencing).

    Each heap entry is a k-tuple of partial sets sorted by sum; the two entries with the
    largest spread are merged largest-with-smallest until one remains. O(n log n * k).
    Returned sets are sorted by index; the list of sets is ordered by descending sum.
    """
    if k < 1:
        raise PlanError(f"k={k} must be >= 1")
    heap = []
    for i, c in enumerate(costs):
        parts = [(float(c), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(c), i, parts))  # spread = max - min = c
    if not heap:
        return [[] for _ in range(k)]
    tie = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda p: (-p[0], min(p[1]) if p[1] else tie))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(p[1]) for p in heap[0][2]]


def _refine(
    sets: list[list[int]], costs: Sequence[float], max_rounds: int = 200
) -> list[list[int]]:
    """Greedy improvement: move or swap one item between the heaviest and the lightest set
    while that lowers the heaviest sum. Deterministic."""
    sums = [sum(costs[i] for i in s) for s in sets]
    for _ in range(max_rounds):
        hi = max(range(len(sets)), key=lambda r: (sums[r], -r))
        best = None  # (new larger sum of the pair, lo, i, j)
        for lo in [min(range(len(sets)), key=lambda r: (sums[r], r))]:
            if lo == hi:
                continue
            gap = sums[hi] - sums[lo]
            for i in sets[hi]:
                d = costs[i]
                if 0 < d < gap:  # move i from hi to lo
                    cand = max(sums[hi] - d, sums[lo] + d)
                    if best is None or cand < best[0]:
                        best = (cand, lo, i, None)
                for j in sets[lo]:
                    d = costs[i] - costs[j]
                    if 0 < d < gap:
                        cand = max(sums[hi] - d, sums[lo] + d)
                        if best is None or cand < best[0]:
                            best = (cand, lo, i, j)
        if best is None or best[0] >= sums[hi]:
            break
        _, lo, i, j = best
        sets[hi].remove(i)
        sets[lo].append(i)
        sums[hi] -= costs[i]
        sums[lo] += costs[i]
        if j is not None:
            sets[lo].remove(j)
            sets[hi].append(j)
            sums[hi] += costs[j]
            sums[lo] -= costs[j]
    return [sorted(s) for s in sets]


def first_fit_decreasing(
    indices: Sequence[int], seqlens: Sequence[int], budget: int
) -> list[list[int]]:
    """Bin-pack ``indices`` by ``seqlens`` into bins of at most ``budget`` tokens (FFD)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-seqlens[i], i)):
        for b, load in enumerate(loads):
            if load + seqlens[i] <= budget:
                bins[b].append(i)
                loads[b] += seqlens[i]
                break
        else:
            bins.append([i])
            loads.append(seqlens[i])
    return bins


def _pack_search(
    indices: list[int], seqlens: Sequence[int], m: int, budget: int, node_limit: int = 5000
) -> list[list[int]] | None:
    """``indices`` into exactly ``m`` bins of at most ``budget`` tokens, or ``None``.

    Depth-first over the sequences in decreasing length, each tried in the bins from the
    lightest up (the first leaf is longest-processing-time, i.e. worst-fit decreasing), bins
    of equal load tried once (they are interchangeable); bins are kept in a sorted list, so
    a placement costs O(log m) comparisons. Exact when it finishes within
    ``node_limit`` placements; ``None`` also when it gives up. Deterministic.
    """
    order = sorted(indices, key=lambda i: (-seqlens[i], i))
    if not order:
        return [[] for _ in range(m)]
    if seqlens[order[0]] > budget or sum(seqlens[i] for i in order) > m * budget:
        return None
    bins = [(0, b) for b in range(m)]  # (load, bin), kept sorted
    where: list[tuple[int, int]] = []  # (load before, bin) of order[k], k < depth
    tried = [-1]  # per depth: the largest bin load tried so far
    nodes = 0
    while tried:
        depth = len(where)
        n = seqlens[order[depth]]
        pos = bisect.bisect_right(bins, (tried[-1], m))  # lightest bin heavier than tried
        if pos == m or bins[pos][0] + n > budget:  # depth exhausted: undo the one above
            tried.pop()
            if where:
                load, b = where.pop()
                del bins[bisect.bisect_left(bins, (load + seqlens[order[depth - 1]], b))]
                bisect.insort(bins, (load, b))
            continue
        nodes += 1
        if nodes > node_limit:
            return None
        load, b = bins.pop(pos)
        tried[-1] = load
        bisect.insort(bins, (load + n, b))
        where.append((load, b))
        if len(where) == len(order):
            out: list[list[int]] = [[] for _ in range(m)]
            for k, (_, b) in enumerate(where):
                out[b].append(order[k])
            return [sorted(x) for x in out]
        tried.append(-1)
    return None


def _fit_rank(
    indices: list[int], seqlens: Sequence[int], m: int, budget: int
) -> list[list[int]] | None:
    """Some ``m`` micro-batches under ``budget`` tokens each for ``indices``, or ``None``:
    the bounded exact search, else first-fit-decreasing when it needs at most ``m`` bins."""
    found = _pack_search(indices, seqlens, m, budget)
    if found is not None:
        return found
    bins = first_fit_decreasing(indices, seqlens, budget)
    return bins + [[] for _ in range(m - len(bins))] if len(bins) <= m else None


def _split_rank(
    indices: list[int], seqlens: Sequence[int], m: int, budget: int, fit: list[list[int]]
) -> list[list[int]]:
    """Exactly ``m`` micro-batches (some possibly empty) under ``budget`` tokens each: KK into
    ``m`` token-balanced parts, or, if one breaks the budget, ``fit`` (a feasible split from
    ``_fit_rank``) balanced by ``_refine`` (which only ever lowers the heaviest bin)."""
    if not indices:
        return [[] for _ in range(m)]
    toks = [float(seqlens[i]) for i in indices]
    parts = karmarkar_karp(toks, m)
    parts = [[indices[j] for j in p] for p in parts]
    if all(sum(seqlens[i] for i in p) <= budget for p in parts):
        return parts
    return _refine([list(b) for b in fit], [float(n) for n in seqlens])


def micro_batch_count_bounds(
    ranks: Sequence[Sequence[int]],
    seqlens: Sequence[int],
    budget: int,
    pp_size: int = 1,
    min_micro_batches: int = 1,
) -> tuple[int, int]:
    """``(lower, ffd)``: where the search for the per-rank micro-batch count starts and where
    it is sure to end, both multiples of ``pp_size`` and ``>= min_micro_batches``.

    ``lower`` is the largest, over ranks, of ``ceil(rank tokens / budget)`` and of the number of
    sequences longer than half the budget (no two share a micro-batch); ``ffd`` is the largest
    first-fit-decreasing bin count over ranks (always feasible).
    """

    def up(m: int) -> int:
        m = max(m, min_micro_batches, 1)
        return -(-m // pp_size) * pp_size

    lower = max(
        [
            max(
                -(-sum(seqlens[i] for i in r) // budget),
                sum(1 for i in r if 2 * seqlens[i] > budget),
            )
            for r in ranks
        ]
        or [0]
    )
    ffd = max([len(first_fit_decreasing(r, seqlens, budget)) for r in ranks] or [0])
    return up(lower), up(ffd)


def _pyramid(mbs: list[list[int]], costs: Sequence[float]) -> list[list[int]]:
    """Order micro-batches small, ..., large, ..., small; empty ones go last."""
    full = [mb for mb in mbs if mb]
    empty = [mb for mb in mbs if not mb]
    full.sort(key=lambda mb: (sum(costs[i] for i in mb), mb[0]))
    left, right = [], []
    for k, mb in enumerate(full):
        (left if k % 2 == 0 else right).append(mb)
    return left + right[::-1] + empty


def plan_micro_batches(
    seqlens: Sequence[int],
    *,
    dp_size: int,
    max_tokens_per_mb: int,
    pp_size: int = 1,
    min_micro_batches: int = 1,
    balance_by: str = "tokens",
    flops_linear_coef: float = 49152.0,
) -> list[list[list[int]]]:
    """Assign sample indices to DP ranks and micro-batches; see the module docstring.

    Returns ``plan`` with ``len(plan) == dp_size`` and ``len(plan[r]) == m`` for every rank,
    ``m % pp_size == 0``, each micro-batch's token sum ``<= max_tokens_per_mb``, and every
    index ``0..len(seqlens)-1`` exactly once. Raises :class:`PlanError` for a sequence longer
    than the budget (naming its index and length) or invalid arguments.
    """
    for name, v in (
        ("dp_size", dp_size),
        ("max_tokens_per_mb", max_tokens_per_mb),
        ("pp_size", pp_size),
        ("min_micro_batches", min_micro_batches),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{name}={v!r}: must be an int >= 1")
    lens = []
    for i, n in enumerate(seqlens):
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise PlanError(f"sequence {i}: length {n!r} must be a positive int")
        n = int(n)
        if n > max_tokens_per_mb:
            raise PlanError(
                f"sequence {i}: length {n} exceeds max_tokens_per_mb="
                f"{max_tokens_per_mb}; raise the budget or truncate it"
            )
        lens.append(n)
    costs = sequence_costs(lens, balance_by, flops_linear_coef)
    ranks = (
        _refine(karmarkar_karp(costs, dp_size), costs) if dp_size > 1 else [list(range(len(lens)))]
    )
    lower, ffd = micro_batch_count_bounds(
        ranks, lens, max_tokens_per_mb, pp_size, min_micro_batches
    )
    for m in range(lower, ffd + 1, pp_size):  # fewest micro-batches every rank can fit into
        fits = []
        for r in ranks:  # stop at the first rank that does not fit
            fits.append(_fit_rank(r, lens, m, max_tokens_per_mb))
            if fits[-1] is None:
                break
        else:
            break
    plan = [
        _pyramid(_split_rank(r, lens, m, max_tokens_per_mb, f), costs) for r, f in zip(ranks, fits)
    ]
    return plan


def plan_stats(
    plan: list[list[list[int]]],
    seqlens: Sequence[int],
    max_tokens_per_mb: int,
    balance_by: str = "tokens",
    flops_linear_coef: float = 49152.0,
) -> dict:
    """Quality figures: DP imbalance (max/mean rank cost), micro-batch count and fill ratio
    (real tokens / (non-empty micro-batches x budget)), empty micro-batches."""
    costs = sequence_costs(seqlens, balance_by, flops_linear_coef)
    loads = [sum(costs[i] for mb in rank for i in mb) for rank in plan]
    mean = sum(loads) / len(loads) if loads else 0.0
    mbs = [mb for rank in plan for mb in rank]
    full = [mb for mb in mbs if mb]
    tokens = sum(seqlens[i] for mb in full for i in mb)
    return {
        "imbalance": (max(loads) / mean) if mean else 1.0,
        "micro_batches_per_rank": len(plan[0]) if plan else 0,
        "empty_micro_batches": len(mbs) - len(full),
        "fill_ratio": tokens / (len(full) * max_tokens_per_mb) if full else 0.0,
    }

"""Shared prompt prefixes: a GRPO group's prompt computed once per micro-batch (pure planning).

The samples of a GRPO group (and the calls of a multi-turn episode that restart from the same
context) begin with the same prompt. Packed one after the other, every sample recomputes it:
with 8 samples of a 60-token prompt and 16-token answers, 80% of the packed tokens are copies.
Since attention is causal, the prompt's hidden states do not depend on what follows, so the
model can run a *tree*: the shared prefix once, then each sample's own tokens attending to it
and to themselves, with the positions they would have had. Outputs equal the unshared ones;
gradients too (each copy's contribution is summed into the shared tokens instead of into its
copy).

What is shared: the rows before each sample's first loss row (``loss_mask``, in the engine's
next-token layout: row t predicts ``labels[t]``) when their tokens and labels are equal in
several samples of the micro-batch. With next-token labels that is the prompt but its last
token: the last prompt row predicts each sample's own first answer token, so it stays with
each sample (a *branch* starts there). No loss row is shared.

Layout of the compressed micro-batch (``keep``: its tokens as indices of the packed one):
per group, at the place of its first sample, the shared part then each branch; every other
slot as it was. ``expand`` maps each packed token to its compressed row, so a per-token result
of the model (log-probabilities, entropies) is ``result[expand]`` in the packed layout.
``units`` say who attends to what: ``(start, length, ctx_start, ctx_len)`` in compressed
indices: the queries ``[start, start + length)`` see the keys ``[ctx_start, ctx_start +
ctx_len)`` and, causally, their own; positions are ``ctx_len + i``. A plain slot or a shared
part has ``ctx_len == 0``.

Plain data in, plain data out (lists of ints): no torch, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from areal_mega.scheduler.planner import plan_micro_batches

__all__ = [
    "SharedPrefixLayout",
    "first_loss_offsets",
    "prompt_groups",
    "plan_shared_prefix",
    "group_units",
    "plan_grouped_micro_batches",
]


@dataclass(frozen=True)
class SharedPrefixLayout:
    """A micro-batch's compressed layout (see the module docstring). ``saved``: packed tokens
    not computed (``len(expand) - len(keep)``)."""

    keep: list[int]
    expand: list[int]
    units: list[tuple[int, int, int, int]]

    @property
    def saved(self) -> int:
        return len(self.expand) - len(self.keep)


def first_loss_offsets(loss_mask: Sequence, bounds: Sequence[int]) -> list[Optional[int]]:
    """Per slot ``[bounds[i], bounds[i+1])`` of a packed ``loss_mask``: the offset of its first
    loss row inside the slot, or None when it has none."""
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        out.append(next((j - s for j in range(s, e) if loss_mask[j]), None))
    return out


def prompt_groups(
    tokens: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    first_loss: Sequence[Optional[int]],
) -> list[list[int]]:
    """Indices of the samples in groups whose rows before ``first_loss`` hold equal tokens and
    labels, in order of first appearance; a sample without a loss row, or with fewer than 2
    rows before it (nothing worth sharing), is a group of its own."""
    groups: dict[tuple, list[int]] = {}
    order: list[list[int]] = []
    for i, (toks, labs, f) in enumerate(zip(tokens, labels, first_loss)):
        if f is None or f < 2:
            order.append([i])
            continue
        key = (tuple(int(t) for t in toks[:f]), tuple(int(t) for t in labs[:f]))
        if key not in groups:
            groups[key] = []
            order.append(groups[key])
        groups[key].append(i)
    return order


def plan_shared_prefix(
    input_ids: Sequence[int], labels: Sequence[int], bounds: Sequence[int], loss_mask: Sequence
) -> Optional[SharedPrefixLayout]:
    """The compressed layout of a packed micro-batch (slots ``bounds``, tokens past
    ``bounds[-1]`` are trailing padding), or None when no two slots share a prompt."""
    total = len(input_ids)
    slots = [(s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    firsts = first_loss_offsets(loss_mask, bounds)
    groups = prompt_groups(
        [input_ids[s:e] for s, e in slots], [labels[s:e] for s, e in slots], firsts
    )
    if all(len(g) < 2 for g in groups):
        return None
    keep: list[int] = []
    expand = [0] * total
    units: list[tuple[int, int, int, int]] = []

    def place(lo: int, hi: int, ctx: tuple[int, int] = (0, 0)) -> int:
        start = len(keep)
        for j in range(lo, hi):
            expand[j] = len(keep)
            keep.append(j)
        units.append((start, hi - lo, ctx[0], ctx[1]))
        return start

    for g in groups:
        if len(g) == 1:
            place(*slots[g[0]])
            continue
        shared = firsts[g[0]]
        lo0 = slots[g[0]][0]
        prefix = place(lo0, lo0 + shared)
        for i in g[1:]:  # their shared rows are the first sample's
            lo = slots[i][0]
            for j in range(shared):
                expand[lo + j] = prefix + j
        for i in g:
            lo, hi = slots[i]
            place(lo + shared, hi, (prefix, shared))
    if bounds[-1] < total:
        place(bounds[-1], total)
    return SharedPrefixLayout(keep=keep, expand=expand, units=units)


def group_units(
    groups: Sequence[Sequence[int]], lengths: Sequence[int], shared: Sequence[int], budget: int
) -> list[tuple[list[int], int]]:
    """Planning units for the micro-batch planner: each group of samples (``lengths``, sharing
    ``shared[k]`` tokens in group ``k``) as ``(members, cost)`` with ``cost`` the compressed
    token count, split into consecutive pieces of at most ``budget`` tokens (a piece keeps
    at least one sample, so a sample longer than the budget is a piece of its own and the
    planner reports it)."""
    out: list[tuple[list[int], int]] = []
    for g, s in zip(groups, shared):
        piece: list[int] = []
        cost = 0
        for i in g:
            add = lengths[i] - s if piece else lengths[i]
            if piece and cost + add > budget:
                out.append((piece, cost))
                piece, cost, add = [], 0, lengths[i]
            piece.append(i)
            cost += add
        if piece:
            out.append((piece, cost))
    return out


def plan_grouped_micro_batches(
    tokens: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence],
    *,
    max_tokens_per_mb: int,
    **plan_kw,
) -> list[list[list[int]]]:
    """:func:`~areal_mega.scheduler.planner.plan_micro_batches` for an engine that computes
    shared prompts once: the samples (next-token layout) of a prompt group go to the same
    micro-batch, in budget-sized pieces, and the budget counts the tokens the model computes.
    Same plan format and errors (a sample longer than the budget is named by its index)."""
    lengths = [len(t) for t in tokens]
    if any(n > max_tokens_per_mb or n < 1 for n in lengths):  # the planner's error names it
        plan_micro_batches(
            lengths,
            max_tokens_per_mb=max_tokens_per_mb,
            **{**plan_kw, "dp_size": 1, "pp_size": 1, "min_micro_batches": 1},
        )
    firsts = [next((j for j, m in enumerate(mask) if m), None) for mask in loss_masks]
    groups = prompt_groups(tokens, labels, firsts)
    shared = [firsts[g[0]] if len(g) > 1 else 0 for g in groups]
    units = group_units(groups, lengths, shared, max_tokens_per_mb)
    unit_plan = plan_micro_batches(
        [cost for _, cost in units], max_tokens_per_mb=max_tokens_per_mb, **plan_kw
    )
    return [[[i for u in mb for i in units[u][0]] for mb in rank] for rank in unit_plan]

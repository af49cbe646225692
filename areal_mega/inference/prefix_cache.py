"""A radix tree of token-id sequences whose tokens carry cached per-token data (the KV of the
rollout server's prefix cache, and the routed experts of a MoE model), with least-recently-used
eviction of leaves under a byte budget.

Plain data structure: no model, no engine. A payload is a tuple of tensors (or None) whose
entry ``i`` holds one slice per token along dimension ``token_dims[i]``; a node holds the
payload of its own token segment. :meth:`PrefixTree.match` answers the longest cached prefix
of a sequence (the payload as the per-node pieces, in order: concatenating them along each
entry's token dimension gives the prefix's data); :meth:`PrefixTree.insert` adds a sequence,
storing data only for the tokens not cached yet. Nodes are split where sequences diverge, so
the samples of one prompt share the prompt's data once. Used on one thread only (the engine's).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["PrefixTree", "common_prefix_len", "concat_pieces"]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _slice(payload: Optional[tuple], dims: tuple, start: int, end: int) -> Optional[tuple]:
    if payload is None:
        return None
    return tuple(
        None if t is None else t.narrow(d, start, end - start).clone()
        for t, d in zip(payload, dims)
    )


def _nbytes(payload: Optional[tuple]) -> int:
    if payload is None:
        return 0
    return sum(t.numel() * t.element_size() for t in payload if t is not None)


class _Node:
    __slots__ = ("tokens", "payload", "children", "parent", "last_used", "nbytes")

    def __init__(self, tokens: list, payload: Optional[tuple], parent: Optional["_Node"]):
        self.tokens = tokens
        self.payload = payload
        self.children: dict = {}
        self.parent = parent
        self.last_used = 0
        self.nbytes = _nbytes(payload)


class PrefixTree:
    """Token sequences with per-token payloads, at most ``budget_bytes`` of payload kept
    (least recently used leaves evicted first; a budget of 0 keeps nothing)."""

    def __init__(self, budget_bytes: int, token_dims: tuple = ()):
        self.budget_bytes = int(budget_bytes)
        self.token_dims = tuple(token_dims)
        self.evicted_tokens = 0
        self.clear()

    def clear(self) -> None:
        """Forget every sequence."""
        self.root = _Node([], None, None)
        self.nbytes = 0
        self.num_tokens = 0
        self._tick = 0

    def _touch(self, node: _Node) -> None:
        self._tick += 1
        while node is not None:
            node.last_used = self._tick
            node = node.parent

    def match(self, tokens: Sequence[int], limit: Optional[int] = None) -> tuple:
        """``(n, pieces)``: the longest cached prefix of ``tokens`` (at most ``limit`` tokens)
        and its payload as per-node pieces in order (``[]`` when ``n == 0``). Marks the path
        used."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, n, pieces, last = self.root, 0, [], self.root
        while n < limit:
            child = node.children.get(tokens[n])
            if child is None:
                break
            k = common_prefix_len(child.tokens, tokens[n:limit])
            if k == 0:
                break
            if child.payload is not None:
                pieces.append(
                    child.payload
                    if k == len(child.tokens)
                    else tuple(
                        None if t is None else t.narrow(d, 0, k)
                        for t, d in zip(child.payload, self.token_dims)
                    )
                )
            n += k
            last = child
            if k < len(child.tokens):
                break
            node = child
        if n:
            self._touch(last)
        return n, pieces

    def insert(
        self, tokens: Sequence[int], payload_of: Optional[Callable[[int, int], tuple]] = None
    ) -> int:
        """Add sequence ``tokens``; ``payload_of(start, end)`` gives the data of tokens
        ``[start, end)`` (called only for tokens not cached yet). Returns how many tokens were
        new; evicts to the budget afterwards (possibly this very sequence)."""
        if self.budget_bytes <= 0 or not tokens:
            return 0
        tokens = list(tokens)
        node, n = self.root, 0
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                break
            k = common_prefix_len(child.tokens, tokens[n:])
            if k < len(child.tokens):
                child = self._split(child, k)
            n += k
            node = child
        added = len(tokens) - n
        if added:
            payload = None if payload_of is None else payload_of(n, len(tokens))
            leaf = _Node(tokens[n:], payload, node)
            node.children[tokens[n]] = leaf
            self.nbytes += leaf.nbytes
            self.num_tokens += added
            node = leaf
        self._touch(node)
        self._evict()
        return added

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child`` after its first ``k`` tokens; returns the new upper node."""
        dims = self.token_dims
        upper = _Node(child.tokens[:k], _slice(child.payload, dims, 0, k), child.parent)
        upper.last_used = child.last_used
        upper.parent.children[upper.tokens[0]] = upper
        lower_payload = _slice(child.payload, dims, k, len(child.tokens))
        self.nbytes += upper.nbytes + _nbytes(lower_payload) - child.nbytes
        child.tokens, child.payload = child.tokens[k:], lower_payload
        child.nbytes, child.parent = _nbytes(lower_payload), upper
        upper.children[child.tokens[0]] = child
        return upper

    def _leaves(self) -> list:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes:
            leaves = self._leaves()
            if not leaves:
                return
            for leaf in sorted(leaves, key=lambda x: x.last_used):
                del leaf.parent.children[leaf.tokens[0]]
                self.nbytes -= leaf.nbytes
                self.num_tokens -= len(leaf.tokens)
                self.evicted_tokens += len(leaf.tokens)
                if self.nbytes <= self.budget_bytes:
                    return

    def stats(self) -> dict:
        """Sizes for the server's info endpoint."""
        return {
            "budget_mb": self.budget_bytes / 2**20,
            "used_mb": self.nbytes / 2**20,
            "tokens": self.num_tokens,
            "evicted_tokens": self.evicted_tokens,
        }


def concat_pieces(pieces: list, token_dims: tuple) -> Optional[tuple]:
    """The payload of a matched prefix: :meth:`PrefixTree.match`'s pieces concatenated along
    each entry's token dimension (an entry missing from any piece is None)."""
    if not pieces:
        return None
    out = []
    for i, d in enumerate(token_dims):
        parts = [p[i] for p in pieces]
        out.append(
            None
            if any(t is None for t in parts)
            else parts[0]
            if len(parts) == 1
            else torch.cat(parts, dim=d)
        )
    return tuple(out)

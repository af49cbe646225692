"""The rollout engine's prefix cache: requests whose prompts start with tokens already
forwarded (a GRPO group's samples of one prompt; the next call of a multi-turn episode) reuse
those tokens' keys/values instead of recomputing them, as SGLang's radix cache does.

SGLang's semantics, kept here:

* a request matches at most ``len(prompt) - 1`` tokens (the last prompt token is always
  forwarded, its logits give the first sampled token), and with ``return_logprob`` at most
  ``logprob_start_len`` tokens (SGLang's ``Req.adjust_max_prefix_ids``);
* ``meta_info.cached_tokens`` is the number of prompt tokens taken from the cache (SGLang's
  ``req.cached_tokens += pre_len - req.already_computed`` in ``prepare_for_extend``, with
  nothing computed before the first prefill);
* a prompt is cached once prefilled, a finished (or aborted) request's whole sequence, prompt
  and output but the last token (whose key/value was never computed), when it leaves the batch;
* of requests admitted together, one with at most :data:`IN_BATCH_THRESHOLD` tokens cached
  that shares at least that many prompt tokens with one chosen before it waits for the next
  round, when it finds them in the cache: a group's first sample goes now, the others right
  after it (SGLang's in-batch prefix caching in ``SchedulePolicy._compute_prefix_matches``,
  both thresholds 32);
* ``/flush_cache`` empties the cache (refused while requests run or wait, as on SGLang); a
  weight update empties it too, and a sequence whose keys/values were computed before an
  update is never added after it (every row remembers the cache epoch of its prefill);
* keys/values depend on the LoRA adapter a request runs with, so the cache has one namespace
  per adapter load (its uid, SGLang's ``lora_id``, which its radix cache keys by; a reload of
  a name is a new namespace) and one for the base model; a request matches only its own. All
  namespaces share the budget; when they exceed it together, whole least recently used
  namespaces other than the one written are dropped (within a namespace, least recently
  used leaves go first, as before);
* with route capture on, each cached token keeps the routed experts computed when it was
  forwarded (SGLang keeps routes per KV slot), so ``meta_info.routed_experts`` is the same with
  or without the cache.

The tree itself is :class:`~areal_mega.inference.prefix_cache.PrefixTree`; payload entries are
the keys/values (layout of :class:`~areal_mega.inference.kv_cache.StaticKVBatch`) and the
routes ``[tokens, layers, topk]`` (None without route capture).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from areal_mega.inference.kv_cache import StaticKVBatch
from areal_mega.inference.prefix_cache import PrefixTree, concat_pieces

__all__ = ["IN_BATCH_THRESHOLD", "DEFAULT_PREFIX_CACHE_MB", "PrefixReuse"]

# SGLang's IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD / ..._DEPRIORITIZE_THRESHOLD
IN_BATCH_THRESHOLD = 32
DEFAULT_PREFIX_CACHE_MB = 512.0
_NO_LIMIT = 1 << 62


def prefix_limit(r) -> int:
    """The most tokens request ``r`` may take from the cache (SGLang's
    ``adjust_max_prefix_ids``)."""
    cap = len(r.input_ids) - 1
    if r.prefix_limit is not None:
        cap = min(cap, r.prefix_limit)
    return max(cap, 0)


class PrefixReuse:
    """The cache of one :class:`~areal_mega.inference.decoding.BatchedEngine` (engine thread
    only); ``budget_mb`` of keys/values and routes at most."""

    def __init__(self, batch: StaticKVBatch, budget_mb: float, with_routes: bool):
        self.batch = batch
        self.with_routes = with_routes
        self.budget = int(budget_mb * 2**20)
        # one tree per namespace (None: the base model, else an adapter load's uid), least
        # recently used first; together within the budget
        self.trees: "OrderedDict[Optional[str], PrefixTree]" = OrderedDict()
        self._planned: set = set()  # namespaces of the current round: never dropped in it
        self.dropped_tokens = 0  # tokens of whole namespaces dropped for room
        self.epoch = 0  # bumped when the cache is emptied: older rows are not added back

    @staticmethod
    def namespace(r) -> Optional[str]:
        """The cache namespace of request ``r``: its adapter load's uid, None for the base."""
        lora = getattr(r, "lora", None)
        return None if lora is None else lora.uid

    def _tree(self, r, create: bool = False) -> Optional[PrefixTree]:
        ns = self.namespace(r)
        tree = self.trees.get(ns)
        if tree is None and create:
            tree = self.trees[ns] = PrefixTree(
                self.budget, token_dims=(StaticKVBatch.KV_TOKEN_DIM, 0)
            )
        if tree is not None:
            self.trees.move_to_end(ns)
        return tree

    def _insert(self, r, tokens: list, payload) -> None:
        """Insert into ``r``'s namespace, then drop whole least recently used namespaces
        (not this one, none planned in this round) while all of them exceed the budget."""
        tree = self._tree(r, create=True)
        tree.insert(tokens, payload)
        for ns in list(self.trees):
            if sum(t.nbytes for t in self.trees.values()) <= self.budget:
                break
            if self.trees[ns] is not tree and ns not in self._planned:
                self.dropped_tokens += self.trees.pop(ns).num_tokens

    def invalidate(self) -> None:
        """Forget everything, and never add rows prefilled before now."""
        self.trees.clear()
        self.epoch += 1

    def plan(self, reqs: list) -> tuple:
        """Split ``reqs`` into ``(now, later)``: ``now`` is ``[(request, cached length)]`` to
        prefill in this round, ``later`` the requests to match again once ``now`` is cached
        (see the module docstring). Requests match only their own namespace's keys/values."""
        now, later = [], []
        in_batch: dict = {}
        self._planned = set()
        for r in reqs:
            cap = prefix_limit(r)
            tree = self._tree(r) if cap else None
            cached = tree.match(r.input_ids, cap)[0] if tree is not None else 0
            mine = in_batch.setdefault(self.namespace(r), PrefixTree(_NO_LIMIT))
            if cached <= IN_BATCH_THRESHOLD and cap:
                shared = mine.match(r.input_ids, cap)[0]
                if shared >= IN_BATCH_THRESHOLD:
                    later.append(r)
                    continue
            mine.insert(r.input_ids)
            if cached:
                self._planned.add(self.namespace(r))
            now.append((r, cached))
        return now, later

    def fetch(self, r, n: int) -> tuple:
        """``(prefix, routes)`` of the first ``n`` prompt tokens of request ``r`` (which
        :meth:`plan` found cached in its namespace): the keys/values as the batch's
        ``prefill`` takes them and the routes ``[n, layers, topk]`` (None without route
        capture)."""
        tree = self._tree(r)
        got, pieces = (0, []) if tree is None else tree.match(r.input_ids, n)
        if got != n:
            raise RuntimeError(f"prefix cache: {n} tokens planned, {got} found")
        kv, routes = concat_pieces(pieces, tree.token_dims)
        return self.batch.split_payload(kv), None if routes is None else routes.numpy()

    def add_prefill(self, reqs: list, kv: list, with_routes: bool) -> None:
        """Cache the prompts of a prefill's requests ``reqs`` (row ``b`` of its keys/values
        ``kv`` is ``reqs[b]``, covering its whole prompt), each prompt once per namespace;
        ``with_routes``: the requests' routes were recorded (their prompts' routes)."""
        seen = set()
        for b, r in enumerate(reqs):
            key = (self.namespace(r), tuple(r.input_ids))
            if key not in seen:
                seen.add(key)
                self.add_prefilled(r, kv, b, np.concatenate(r.routes) if with_routes else None)

    def add_prefilled(self, r, kv: list, row: int, routes: Optional[np.ndarray]) -> None:
        """Cache the prompt of ``r``, row ``row`` of a prefill's keys/values ``kv`` (covering
        the whole prompt); ``routes``: the prompt's routes."""

        def payload(start: int, end: int) -> tuple:
            return (
                StaticKVBatch.payload_of_prefill(kv, row, start, end),
                None if routes is None else torch.from_numpy(routes[start:end].copy()),
            )

        self._insert(r, r.input_ids, payload)

    def add_running(self, r, row: int) -> None:
        """Cache what running row ``row`` (request ``r``, leaving the batch) has computed:
        its prompt and every output token but the last. Skipped for a row prefilled before
        the last :meth:`invalidate`, or whose length does not match its tokens."""
        n = self.batch.row_len(row)
        if r.kv_epoch != self.epoch or n != len(r.input_ids) + len(r.output_ids) - 1:
            return
        routes = None
        if self.with_routes:
            routes = np.concatenate(r.routes) if r.routes else None
            if routes is None or len(routes) < n:
                return
        tokens = list(r.input_ids) + list(r.output_ids[: n - len(r.input_ids)])

        def payload(start: int, end: int) -> tuple:
            return (
                self.batch.payload_of_row(row, start, end),
                None if routes is None else torch.from_numpy(routes[start:end].copy()),
            )

        self._insert(r, tokens, payload)

    def stats(self) -> dict:
        """The trees' sizes together, the number of namespaces and the current epoch."""
        parts = [t.stats() for t in self.trees.values()]
        return {
            "budget_mb": self.budget / 2**20,
            "used_mb": sum(p["used_mb"] for p in parts),
            "tokens": sum(p["tokens"] for p in parts),
            "evicted_tokens": sum(p["evicted_tokens"] for p in parts) + self.dropped_tokens,
            "namespaces": len(parts),
            "epoch": self.epoch,
        }

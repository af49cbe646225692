"""Iteration-level batched generation on a HF causal LM (CPU), the core of the local server.

One engine thread owns the model. Each iteration it
1. applies queued commands (weight loads, pause) between decode steps,
2. admits waiting requests (one prefill forward per prompt length and cached prefix; a
   prompt's cached prefix is not recomputed, see :mod:`areal_mega.inference.prefix_reuse`),
   whose rows then join the running batch,
3. runs ONE forward over all active requests (one token each, each at its own position),
   samples one token per request and retires finished ones (continuous batching).

So 8 concurrent requests cost ~one batched forward per token instead of 8. The KV cache of the
running rows and the forward passes over it live in :mod:`areal_mega.inference.kv_cache`.

Sampling (penalties, min_new_tokens, logit bias, temperature, top-k / top-p / min-p) and the
meaning of the returned logprobs are those of SGLang; see :mod:`areal_mega.inference.sampling`.
Finishing follows SGLang's ``Req.check_finished``: ``length`` first, then (unless
``ignore_eos``) a stop token id or an EOS id, then a stop string found in the decoded tail.

A row whose token cannot be sampled (non-finite probabilities, or sampling raises for it) is
finished alone with ``{"type": "abort", "message": "sampling error: ...", "status_code": 400}``
and leaves the batch; the other rows keep decoding.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from areal_mega.inference.cpu_linear import pack_linear_layers
from areal_mega.inference.kv_cache import StaticKVBatch, make_kv_batch
from areal_mega.inference.lora_layers import take_admissible
from areal_mega.inference.prefix_reuse import PrefixReuse
from areal_mega.inference.route_capture import RouteCapture
from areal_mega.inference.sampling import SamplingParams, choose_tokens_isolated
from areal_mega.inference.vl_model import is_vision_config

__all__ = ["BatchedEngine", "GenRequest", "SamplingParams"]

log = logging.getLogger(__name__)


@dataclass
class GenRequest:
    """One generation request inside the engine; ``on_done(self)`` fires exactly once."""

    rid: str
    input_ids: list
    params: SamplingParams
    on_done: Callable[["GenRequest"], None]
    output_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: Optional[dict] = None
    weight_version: str = "0"
    aborted: bool = False
    abort_message: str = ""
    generator: Optional[torch.Generator] = None
    created_at: float = field(default_factory=time.time)
    # SGLang's return_routed_experts: per forward that fed this request, the
    # [tokens, num_hidden_layers, topk] expert ids (see route_capture)
    return_routed_experts: bool = False
    routes_start: int = 0  # routed_experts_start_len: the first position answered
    routes: list = field(default_factory=list)
    # prefix cache: the most prompt tokens it may serve (None: all but the last), how many
    # it served (SGLang's cached_tokens), and the cache epoch of the prefill
    prefix_limit: Optional[int] = None
    cached_tokens: int = 0
    kv_epoch: int = -1
    lora: Optional[object] = None  # the LoraAdapter it runs with (None: the base model)
    # the prompt's images (areal_mega.inference.vl_model.PromptImages; None: a text prompt)
    images: Optional[object] = None

    def _finish(self, reason: dict) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            try:
                self.on_done(self)
            except Exception:  # a broken callback must never kill the engine thread
                log.exception("on_done callback failed for rid=%s", self.rid)


class BatchedEngine:
    """Owns the model and a thread that decodes all active requests together.

    Thread-safe entry points: :meth:`submit`, :meth:`abort`, :meth:`pause`, :meth:`resume`,
    :meth:`run_exclusive` (run a callable on the engine thread between decode steps).
    """

    def __init__(
        self,
        model,
        eos_token_id,
        max_running: int = 64,
        weight_version: str = "0",
        decode: Optional[Callable[[list], str]] = None,
        prepack_linears: bool = True,
        capture_routes: bool = False,
        prefix_cache_mb: float = 0.0,
        lora=None,
        banned_token_ids=(),
    ):
        """``eos_token_id``: one id, a list of ids or None. ``decode(ids) -> str`` is needed
        only for stop strings. ``prepack_linears``: run the model's linear layers through
        oneDNN with prepacked weights (:mod:`areal_mega.inference.cpu_linear`).
        ``capture_routes``: record the routed experts of requests that ask for them
        (:mod:`areal_mega.inference.route_capture`; ValueError for a dense model).
        ``prefix_cache_mb``: memory budget of the prefix cache (0: no cache; only for the
        models :class:`~areal_mega.inference.kv_cache.StaticKVBatch` serves). ``lora``: the
        model's :class:`~areal_mega.inference.lora_layers.LoraLayers` (None: no LoRA).
        ``banned_token_ids``: tokens never sampled (a VL model's vision special tokens): their
        logits are ``-inf`` before sampling, as a ``logit_bias`` of ``-inf`` would make them.
        Requests with images are prefilled with them; the prefix cache never serves or keeps
        their keys/values (a VL model runs on the HF-cache batch, which has no prefix cache)."""
        self.model = model
        self.routes = RouteCapture(model) if capture_routes else None
        self.lora = lora
        self.prepacked_linears = pack_linear_layers(model) if prepack_linears else 0
        self.config = model.config
        if isinstance(eos_token_id, (list, tuple, set, frozenset)):
            self.eos_ids = frozenset(int(t) for t in eos_token_id)
        else:
            self.eos_ids = frozenset() if eos_token_id is None else frozenset([int(eos_token_id)])
        self.decode = decode
        self.max_running = max_running
        self.weight_version = weight_version
        self._cv = threading.Condition()
        self._waiting: deque[GenRequest] = deque()
        # taken off the queue, not prefilled yet: pause and abort must see these too, or a
        # request admitted as a pause arrives runs on into the next weights under the old version
        self._admitting: list[GenRequest] = []
        self._commands: deque = deque()
        self._paused = False
        self._stop = False
        # batch state (engine thread only)
        self._active: list[GenRequest] = []
        self._batch = make_kv_batch(model)  # row i = self._active[i]
        self.banned = torch.tensor(sorted(set(banned_token_ids)), dtype=torch.long)
        self.prefix = None
        if (
            prefix_cache_mb > 0
            and isinstance(self._batch, StaticKVBatch)
            and not is_vision_config(self.config)
        ):
            self.prefix = PrefixReuse(self._batch, prefix_cache_mb, self.routes is not None)
        self.prefill_tokens = 0  # prompt tokens forwarded by prefills
        self.cached_tokens = 0  # prompt tokens served by the prefix cache instead
        self.forward_s = {"prefill": 0.0, "decode": 0.0}  # seconds in the model's forwards
        self._last_tok: list[int] = []
        self.steps = 0
        self.tokens_generated = 0
        self.sampling_errors = 0  # rows finished because their token could not be sampled
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, any thread
    def submit(self, req: GenRequest) -> None:
        """Queue a request; while paused it waits until :meth:`resume`."""
        with self._cv:
            if self._stop:
                req._finish({"type": "abort", "message": "server shutting down"})
                return
            self._waiting.append(req)
            self._cv.notify_all()

    def abort(self, rid: Optional[str] = None, message: str = "aborted by request") -> int:
        """Mark request ``rid`` (or every request when None) aborted; returns how many."""
        n = 0
        with self._cv:
            for r in self._queued_and_running():
                if rid is None or r.rid == rid:
                    r.aborted, r.abort_message = True, message
                    n += 1
            self._cv.notify_all()
        return n

    def _queued_and_running(self) -> list:
        """Every unfinished request once (call with ``self._cv`` held)."""
        reqs = {id(r): r for r in [*self._waiting, *self._admitting, *self._active]}
        return [r for r in reqs.values() if r.finish_reason is None]

    def pause(self) -> None:
        """Abort every running and waiting request (they return their partial output with
        ``finish_reason.type == "abort"``) and hold new ones until :meth:`resume`."""
        with self._cv:
            self._paused = True
            for r in self._queued_and_running():
                r.aborted, r.abort_message = True, "generation paused"
            self._cv.notify_all()

    def resume(self) -> None:
        """Let queued and new requests run again."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def invalidate_prefix_cache(self) -> None:
        """Empty the prefix cache for good: rows prefilled before are never added back (call
        on the engine thread, e.g. from :meth:`run_exclusive`, with new weights)."""
        if self.prefix is not None:
            self.prefix.invalidate()

    def flush_prefix_cache(self) -> bool:
        """SGLang's ``flush_cache``: empty the prefix cache if no request runs or waits;
        returns whether it did (call on the engine thread)."""
        with self._cv:
            if self._waiting or self._admitting or self._active:
                return False
        self.invalidate_prefix_cache()
        return True

    def run_exclusive(self, fn: Callable[[], object], timeout: Optional[float] = None):
        """Run ``fn()`` on the engine thread between decode steps and return its result
        (exceptions are re-raised here)."""
        done = threading.Event()
        box: dict = {}

        def cmd():
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e
            finally:
                done.set()

        with self._cv:
            self._commands.append(cmd)
            self._cv.notify_all()
        if not done.wait(timeout):
            raise TimeoutError("engine command timed out")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def shutdown(self) -> None:
        """Abort everything and stop the engine thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while (
                    not self._stop
                    and not self._commands
                    and not self._active
                    and not (self._waiting and not self._paused)
                    and not any(r.aborted for r in self._waiting)
                ):
                    self._cv.wait()
                stop = self._stop
                commands = list(self._commands)
                self._commands.clear()
                # aborted waiting requests finish at once with no output
                aborted_waiting = [r for r in self._waiting if r.aborted]
                self._waiting = deque(r for r in self._waiting if not r.aborted)
                admit = (
                    []
                    if self._paused or stop
                    else take_admissible(
                        self._waiting,
                        self.max_running - len(self._active),
                        self._active,
                        None if self.lora is None else self.lora.max_per_batch,
                    )
                )
                self._admitting = admit
            for r in aborted_waiting:
                r._finish({"type": "abort", "message": r.abort_message})
            if stop:
                for r in self._active + list(self._waiting):
                    r._finish({"type": "abort", "message": "server shutting down"})
                self._active = []
                for cmd in commands:
                    cmd()
                return
            self._retire_aborted()
            for cmd in commands:
                cmd()
            try:
                self._prefill_admitted(admit)
                with self._cv:
                    self._admitting = []
                self._retire_aborted()
                if self._active:
                    self._decode_step()
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("engine step failed")
                for r in self._active + admit:
                    r._finish({"type": "abort", "message": f"engine error: {e}"})
                with self._cv:
                    self._admitting = []
                self._reset_batch()

    def _reset_batch(self) -> None:
        self._active, self._last_tok = [], []
        self._batch.reset()

    def _retire_aborted(self) -> None:
        if any(r.aborted for r in self._active):
            keep = [i for i, r in enumerate(self._active) if not r.aborted]
            self._cache_leaving(keep)
            for r in self._active:
                if r.aborted:
                    r._finish({"type": "abort", "message": r.abort_message})
            self._select(keep)

    def _prefill_admitted(self, admit: list) -> None:
        """Prefill newly admitted requests, one forward per (cached prefix, uncached length):
        equal-length inputs need no padding, so the batched forward gives each row exactly
        what a forward of that prompt alone gives. With the prefix cache, requests that share
        a prompt prefix go in rounds (:meth:`PrefixReuse.plan`), later ones from the cache."""
        pending = []
        for r in admit:
            if r.aborted:
                r._finish({"type": "abort", "message": r.abort_message})
            elif r.params.max_new_tokens == 0:
                r._finish({"type": "length", "length": 0})
            else:
                pending.append(r)
        while pending:
            if self.prefix is None:
                now, pending = [(r, 0) for r in pending], []
            else:
                now, pending = self.prefix.plan(pending)
            groups: dict = {}
            for r, cached in now:
                key = (
                    tuple(r.input_ids[:cached]),
                    len(r.input_ids) - cached,
                    self.prefix.namespace(r) if cached else None,
                )  # one prefix each
                groups.setdefault(key, []).append(r)
            for (prefix, *_), reqs in groups.items():
                self._prefill_batch(reqs, len(prefix))

    def _prefill_batch(self, reqs: list, cached: int) -> None:
        """Prefill ``reqs``, whose first ``cached`` prompt tokens are the same and cached."""
        epoch = -1 if self.prefix is None else self.prefix.epoch
        for r in reqs:
            r.weight_version, r.cached_tokens, r.kv_epoch = self.weight_version, cached, epoch
        prefix, prefix_routes = self.prefix.fetch(reqs[0], cached) if cached else (None, None)
        ids = torch.tensor([r.input_ids[cached:] for r in reqs], dtype=torch.long)
        n, S = ids.shape
        capture = self._begin_routes(reqs)
        if self.lora is not None:
            self.lora.set_rows([r.lora for r in reqs])
        t0 = time.perf_counter()
        if any(r.images is not None for r in reqs):
            if prefix is not None:  # never: a keys/values cache computed with other images
                raise RuntimeError("a prompt with images was planned on the prefix cache")
            logits, kv = self._batch.prefill(ids, images=[r.images for r in reqs])
        else:
            logits, kv = self._batch.prefill(ids, prefix)
        self.forward_s["prefill"] += time.perf_counter() - t0
        self.prefill_tokens += n * S
        self.cached_tokens += n * cached
        if capture:  # row b of the prefill: its S uncached tokens
            rows = self.routes.end(n * S).reshape(n, S, *capture)
            for r, rr in zip(reqs, rows):
                if prefix_routes is not None:
                    r.routes.append(prefix_routes)
                r.routes.append(rr)
        if self.prefix is not None:
            self.prefix.add_prefill(reqs, kv, bool(capture))
        toks = self._sample_and_record(reqs, logits)
        keep = [
            i
            for i, (r, tok) in enumerate(zip(reqs, toks))
            if tok is not None and not self._check_finished(r, tok)
        ]
        if not keep:
            return
        self._batch.append(kv, keep)
        for i in keep:
            self._active.append(reqs[i])
            self._last_tok.append(toks[i])

    def _decode_step(self) -> None:
        B = len(self._active)
        capture = self._begin_routes(self._active)
        if self.lora is not None:
            self.lora.set_rows([r.lora for r in self._active])
        t0 = time.perf_counter()
        logits = self._batch.decode(self._last_tok)
        self.forward_s["decode"] += time.perf_counter() - t0
        if capture:  # row i: the token fed for request i
            rows = self.routes.end(B)
            for i, r in enumerate(self._active):
                r.routes.append(rows[i : i + 1])
        self.steps += 1
        toks = self._sample_and_record(self._active, logits)
        keep = []
        for i, (r, tok) in enumerate(zip(self._active, toks)):
            if tok is None:  # this row failed to sample and is finished already
                continue
            self._last_tok[i] = tok
            if not self._check_finished(r, tok):
                keep.append(i)
        if len(keep) != B:
            self._cache_leaving(keep)
            self._select(keep)

    def _cache_leaving(self, keep: list) -> None:
        """Add the rows not in ``keep`` (leaving the batch) to the prefix cache."""
        if self.prefix is None:
            return
        kept = set(keep)
        for i, r in enumerate(self._active):
            if i not in kept:
                self.prefix.add_running(r, i)

    def _begin_routes(self, reqs: list) -> Optional[tuple]:
        """Start recording routes when a request of this forward asks for them, or always
        with the prefix cache (a cached token keeps its routes); returns the ``(layers,
        topk)`` of a row then, else None (nothing recorded, nothing to pay)."""
        if self.routes is None or (
            self.prefix is None and not any(r.return_routed_experts for r in reqs)
        ):
            return None
        self.routes.begin()
        lay = self.routes.layout
        return lay.num_hidden_layers, lay.topk

    def _select(self, keep: list) -> None:
        """Keep batch rows ``keep``."""
        if not keep:
            self._reset_batch()
            return
        self._batch.select(keep)
        self._active = [self._active[i] for i in keep]
        self._last_tok = [self._last_tok[i] for i in keep]

    def _sample_and_record(self, reqs: list, logits: torch.Tensor) -> list:
        """Choose one token per row (:func:`~areal_mega.inference.sampling.choose_tokens_isolated`)
        and record token, logprob and top logprobs on each request. A row that fails to
        sample is finished with an abort naming the error and gets None as its token."""
        if self.banned.numel():
            logits[:, self.banned] = float("-inf")
        tok_list, lps, tops, errors = choose_tokens_isolated(reqs, logits, self.eos_ids)
        for r, tok, lp, top, err in zip(reqs, tok_list, lps, tops, errors):
            if err is not None:
                log.warning("rid=%s: %s", r.rid, err)
                self.sampling_errors += 1
                r._finish({"type": "abort", "message": err, "status_code": 400})
                continue
            r.output_ids.append(tok)
            r.logprobs.append(lp)
            if r.params.top_logprobs_num:
                r.top_logprobs.append(top)
            self.tokens_generated += 1
        return tok_list

    def _check_finished(self, r: GenRequest, tok: int) -> bool:
        p = r.params
        if len(r.output_ids) >= p.max_new_tokens:
            r._finish({"type": "length", "length": p.max_new_tokens})
            return True
        if not p.ignore_eos and (tok in p.stop_token_ids or tok in self.eos_ids):
            r._finish({"type": "stop", "matched": tok})
            return True
        if p.stop_strs and self.decode is not None:
            tail = self.decode(r.output_ids[-(p.stop_str_max_len + 1) :])
            for s in p.stop_strs:
                if s in tail:
                    r._finish({"type": "stop", "matched": s})
                    return True
        return False

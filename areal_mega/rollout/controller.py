"""RolloutController: concurrent episodes under the staleness bound, interruptible generation,
weight updates, and delivery of finished groups to a sink.

The rollout worker (:mod:`areal_mega.rollout.worker`) drives it; all calls come from threads
other than the controller's own asyncio thread::

    ctl = RolloutController(client, workflow, prompts, batch_size=B, eta=η, n_samples=n,
                            sink=deliver)   # deliver(group): production, the data plane
    ctl.start()
    ...
    ctl.update_weights(v, path=hf_dir)      # trainer saved HF weights: pause, load, resume
    ctl.begin_weight_update()               # or the trainer broadcasts them itself:
    ...                                     #   pause here, trainer sends, then
    ctl.end_weight_update(v)                #   make v current and resume
    ctl.raise_if_failed()                   # polled: a failure in the loop surfaces here
    ctl.stop()

Finished groups (lists of ``n_samples`` Trajectory) go to ``sink(group)`` in start order (a
finished group waits for the earlier-started ones), so a trainer consuming in arrival order
consumes in start order.

Staleness (units: prompt groups, see :mod:`areal_mega.rollout.staleness`): a group starts only
while ``accepted + running < (η + version + 1) · batch_size``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

from areal_mega.common.moe_routes import RouteLayout, RouteTable
from areal_mega.rollout.client import RolloutClient, RolloutRequestError, RolloutServerError
from areal_mega.rollout.failures import EpisodeFailures, FailureRate
from areal_mega.rollout.generate_result import forbid_tokens, token_versions
from areal_mega.rollout.lora_sync import load_published
from areal_mega.rollout.routes import call_routes
from areal_mega.rollout.staleness import StalenessCounter, sample_version

log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    """A completed (possibly interrupted and resumed) generation."""

    output_ids: list
    logprobs: list
    versions: list
    finish_reason: str  # stop | length | abort (abort only when the controller is stopping)
    n_interruptions: int
    server: str
    # routing replay: [n, MoE layers, topk] routes of positions 0..n-1 of input + output
    routed_experts: Optional[np.ndarray] = None


def model_finish(finish: str, output_ids: list, sampling: dict, tokenizer=None) -> str:
    """The finish reason a trajectory records: ``stop`` when the model itself ended the
    sample. SGLang checks the length limit before EOS, so an EOS (or one of the request's
    ``stop_token_ids``) drawn as the last allowed token is reported as ``length``; rewards
    and the overlong/no-EOS shaping must see that the model ended it."""
    if finish != "length" or not output_ids or sampling.get("ignore_eos"):
        return finish
    ends = set(sampling.get("stop_token_ids") or ())
    eos = getattr(tokenizer, "eos_token_id", None)
    ends |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return "stop" if output_ids[-1] in ends else finish


def request_seed(seed: int, key: str, segment: int) -> int:
    """The sampling seed of one generation request (``rollout.seeded_sampling``): a 63-bit
    hash of the run's ``seed``, the request's ``key`` without the controller's random run id
    (group index, sample, turn) and its ``segment`` (the resumption after an interruption).
    Pure: the same run started again seeds the same requests alike."""
    digest = hashlib.blake2b(f"{seed}:{key}:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class GroupContext:
    """What a workflow sees for one prompt group (``arun_episode(ctx, item, n_samples)``):
    the group's ids, the tokenizer, keyed interruptible generation, rewards and blocking calls
    off the loop. :class:`~areal_mega.workflow.api.SampleContext` is the per-sample view an
    episode function gets; it wraps this one (one group context, ``n_samples`` samples)."""

    def __init__(self, ctl: "RolloutController", group_index: int):
        self.ctl = ctl
        self.group_index = group_index
        self.group_id = f"{ctl.run_id}-g{group_index}"
        self.tokenizer = ctl.tokenizer
        self.image_processor = getattr(ctl, "image_processor", None)  # a VL policy's, else None

    def sample_id(self, j: int) -> str:
        """Unique id of sample ``j`` of this group."""
        return f"{self.group_id}-s{j}"

    async def generate(
        self,
        input_ids: list,
        max_new_tokens: int,
        sample_index: int = 0,
        turn: int = 0,
        image_data: Optional[list] = None,
        **sampling,
    ) -> GenerationOutput:
        """Interruptible generation (see :meth:`RolloutController.generate`)."""
        key = f"{self.sample_id(sample_index)}-t{turn}"
        return await self.ctl.generate(
            input_ids, max_new_tokens, key=key, image_data=image_data, **sampling
        )

    async def reward(self, fn, *args, **kw) -> float:
        """Run a (blocking) reward function off the event loop; errors give 0 and a log line."""
        try:
            return float(await self.run_blocking(fn, *args, **kw))
        except Exception as e:  # noqa: BLE001
            log.warning("reward function failed: %s", e)
            self.ctl.reward_errors += 1
            return 0.0

    def at_close(self, close) -> None:
        """Run the coroutine function ``close()`` on the controller's loop as it ends (once,
        however often it is registered): how a workflow stops what it started on the loop,
        e.g. the OpenAI-compatible endpoint."""
        if close not in self.ctl._closers:
            self.ctl._closers.append(close)

    async def run_blocking(self, fn, *args, **kw):
        """Run ``fn(*args, **kw)`` in the controller's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.ctl._pool, lambda: fn(*args, **kw))


class RolloutController:
    """Runs episodes in a background asyncio thread; see the module docstring."""

    def __init__(
        self,
        client: RolloutClient,
        workflow,
        prompts: Iterable[dict],
        *,
        batch_size: int,
        n_samples: int,
        eta: int,
        max_concurrent: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        tokenizer=None,
        sink: Callable[[list], None],
        initial_version: int = 0,
        max_episode_retries: int = 3,
        on_episode_failure: str = "fail",
        failure_rate: Optional[FailureRate] = None,
        reward_threads: int = 4,
        route_layout: Optional[RouteLayout] = None,
        sampling_seed: Optional[int] = None,
        forbidden_token_ids: Iterable[int] = (),
        image_processor=None,
        **extra_sampling,
    ):
        """``forbidden_token_ids``: tokens no request may sample (a vision-language model's
        vision special tokens, :func:`~areal_mega.inference.vl_model.vision_token_ids`): each
        request's ``logit_bias`` gives them
        :data:`~areal_mega.rollout.generate_result.FORBIDDEN_BIAS`. ``image_processor``: a
        vision-language policy's image processor, which workflows see as
        ``ctx.image_processor`` (None: a text policy)."""
        # retries, drops and the failure-rate ceiling (areal_mega.rollout.failures)
        self.failures = EpisodeFailures(on_episode_failure, max_episode_retries, failure_rate)
        self.client = client
        self.workflow = workflow
        self._prompts = iter(prompts)
        self._requeued: deque = deque()  # (prompt item, failed attempts so far)
        self.n_samples = n_samples
        self.max_concurrent = max_concurrent
        self.sampling = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            **extra_sampling,
        }
        self.forbidden_token_ids = tuple(int(t) for t in forbidden_token_ids)
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.route_layout = route_layout  # set: ask the servers for MoE routes (R3)
        self.sink = sink
        self.run_id = uuid.uuid4().hex[:8]
        self.sampling_seed = sampling_seed  # set: every request seeded (request_seed)
        self.counter = StalenessCounter(batch_size=batch_size, eta=eta, version=initial_version)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            reward_threads, thread_name_prefix="rollout-reward"
        )
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._closers: list = []  # run on the loop as it ends (at_close)
        self._error_lock = threading.Lock()
        self._order: deque = deque()  # started, not delivered group indices
        self._finished: dict = {}  # group index -> list[Trajectory]
        self._sink_lock = asyncio.Lock()  # sink deliveries keep start order
        self._group_ids = itertools.count()
        self._exhausted = False
        self._error: Optional[BaseException] = None
        self._trust_server_version = True
        # statistics
        self.n_started = self.n_finished = self.n_failed = 0
        self.n_interruptions = self.reward_errors = 0
        self.n_inflight_requests = 0
        self.max_running_seen = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RolloutController":
        """Start the background loop; returns self."""
        if self._thread is not None:
            raise RuntimeError("RolloutController already started")
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._gate = asyncio.Event()
            self._gate.set()
            self._wake = asyncio.Event()
            self._stopping = False
            ready.set()
            try:
                self._loop.run_until_complete(self._main())
            except BaseException as e:  # noqa: BLE001 - surfaced by raise_if_failed
                log.exception("rollout controller loop died")
                self._set_error(e)
            finally:
                for close in self._closers:
                    self._loop.run_until_complete(close())
                self._loop.run_until_complete(self.client.close())
                self._loop.close()

        self._thread = threading.Thread(target=run, name="rollout-controller", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop starting groups, abort in-flight requests and join the loop thread."""
        if self._thread is None or self._loop is None:
            return

        def _stop():
            self._stopping = True
            self._gate.set()
            self._wake.set()

        self._loop.call_soon_threadsafe(_stop)
        self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run_async(self, coro) -> concurrent.futures.Future:
        """Run a coroutine on the controller's loop (e.g. client calls from another thread)."""
        if self._loop is None:
            raise RuntimeError("RolloutController not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def raise_if_failed(self) -> None:
        """Raise ``RuntimeError`` (chained to the cause) if the controller has failed: its loop
        died, the servers were unreachable at start, an episode failed on every retry, or the
        sink raised. The first failure is kept; callers poll this (the worker exits on it).
        A prompt fails on its ``max_episode_retries``-th failed attempt, or at once when a
        server rejected its request (HTTP 4xx: it would fail again); with
        ``on_episode_failure="drop"`` it is dropped and counted (``dropped_prompts``) instead,
        until the dropped share passes the failure-rate ceiling (``FailureRateExceeded``, see
        :mod:`areal_mega.rollout.failures`)."""
        with self._error_lock:
            e = self._error
        if e is not None:
            raise RuntimeError(f"rollout failed: {e}") from e

    def _set_error(self, e: BaseException) -> None:
        with self._error_lock:
            self._error = self._error or e

    # ------------------------------------------------------------------ the loop
    async def _main(self) -> None:
        try:
            self._trust_server_version = await self.client.set_weight_version(self.counter.version)
        except RolloutServerError as e:
            raise RuntimeError(f"rollout servers unreachable at start: {e}") from None
        tasks: set = set()
        while not self._stopping:
            c = self.counter
            can = (
                self._gate.is_set()
                and c.capacity() > 0
                and c.running < self.max_concurrent
                and (not self._exhausted or bool(self._requeued))
            )  # retries go on
            if can:
                item, attempt = self._next_prompt()
                if item is None:
                    self._exhausted = True
                    continue
                gidx = next(self._group_ids)
                c.on_start()
                self.n_started += 1
                self.max_running_seen = max(self.max_running_seen, c.running)
                self._order.append(gidx)
                t = asyncio.create_task(self._run_group(gidx, item, attempt))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                continue
            self._wake.clear()
            await self._wake.wait()
        # stopping: interrupt every request and let the tasks unwind
        for t in list(tasks):
            t.cancel()
        try:
            await asyncio.wait_for(self.client.abort(None), 10)
        except Exception:  # noqa: BLE001 - best effort
            pass
        if tasks:
            await asyncio.wait(tasks, timeout=30)

    def _next_prompt(self) -> tuple:
        if self._requeued:
            return self._requeued.popleft()
        return next(self._prompts, None), 0

    async def _run_group(self, gidx: int, item: dict, attempt: int = 0) -> None:
        ctx = GroupContext(self, gidx)
        start_version = self.counter.version
        try:
            group = await self.workflow.arun_episode(ctx, item, self.n_samples)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the prompt is retried, the slot released
            log.warning("episode of group %d failed (attempt %d): %s", gidx, attempt + 1, e)
            self.n_failed += 1
            self.counter.on_finish(accepted=False)  # frees the slot; nothing was accepted
            self._order.remove(gidx)
            retry, err = self.failures.after_failure(attempt, e)
            if retry:
                self._requeued.append((item, attempt + 1))
            elif err is None:  # dropped (a failed run's error is enough said)
                log.warning(
                    "prompt dropped after %d attempts (%d so far): %s; prompt %.200r",
                    attempt + 1,
                    self.failures.n_dropped,
                    e,
                    item,
                )
            if err is not None:
                self._set_error(err)
            self._wake.set()
            await self._deliver_in_order()  # a later-started group may have waited for this one
            return
        for tr in group:
            tr.meta.update(
                {
                    "group_index": gidx,
                    "start_version": start_version,
                    "sample_version": sample_version(tr.versions),
                }
            )
        self.counter.on_finish(accepted=True)
        self.n_finished += 1
        self.failures.record_outcome(True)
        self._wake.set()
        self._finished[gidx] = group
        await self._deliver_in_order()

    def record_outcome(self, ok: bool, reason: str = "", detail: str = "") -> None:
        """Count one task's final outcome that did not come from this controller's prompts
        (e.g. an online gateway session): ``ok``, or given up for ``reason`` (``detail``: its
        error message). Like a prompt out of attempts, a failure fails the run under
        ``on_episode_failure="fail"``; under ``drop`` it is counted (``dropped_prompts``,
        ``dropped/<reason>``) and enters the failure-rate window, whose ceiling fails the run.
        Failures surface in :meth:`raise_if_failed`. Thread-safe."""
        err = self.failures.record_outcome(ok, reason, detail)
        if err is not None:
            self._set_error(err)

    async def _deliver_in_order(self) -> None:
        """Hand finished groups to the sink in start order — a finished group waits for every
        earlier-started one to finish or fail — so that a trainer consuming in arrival order
        consumes in start order, which makes the staleness bound exact (a group started at
        version v is consumed by trainer version v + η). One delivery at a time."""
        async with self._sink_lock:
            while self._order and self._order[0] in self._finished:
                group = self._finished.pop(self._order.popleft())
                try:
                    await asyncio.get_running_loop().run_in_executor(self._pool, self.sink, group)
                except Exception as e:  # noqa: BLE001
                    log.exception("sink failed")
                    self._set_error(e)
                    return

    async def generate(
        self,
        input_ids: list,
        max_new_tokens: int,
        key: str,
        image_data: Optional[list] = None,
        **sampling,
    ) -> GenerationOutput:
        """Generate ``max_new_tokens`` at most; when a weight update interrupts the request
        (``finish_reason == abort``) it waits for the update and resubmits prompt + partial
        output with the remaining budget (and the prompt's ``image_data``, the images of a
        processor-expanded ``input_ids``: SGLang's field, see
        :func:`~areal_mega.rollout.generate_result.generate_body`). Tokens carry the version
        that produced them; with a ``route_layout`` each call returns the routes of its whole
        input and output, and each token's route is the one of the call that last forwarded
        it (:class:`~areal_mega.common.moe_routes.RouteTable`)."""
        out, lps, vers = [], [], []
        seg, server = 0, ""
        routes = RouteTable(self.route_layout) if self.route_layout else None
        sp = dict(self.sampling, **{k: v for k, v in sampling.items() if v is not None})
        while True:
            await self._gate.wait()
            if self._stopping:
                return GenerationOutput(
                    out, lps, vers, "abort", seg, server, routes.rows() if routes else None
                )
            remaining = max_new_tokens - len(out)
            submit_version = self.counter.version
            params = forbid_tokens(dict(sp, max_new_tokens=remaining), self.forbidden_token_ids)
            if self.sampling_seed is not None and sp.get("sampling_seed") is None:
                params["sampling_seed"] = request_seed(
                    self.sampling_seed, key.removeprefix(f"{self.run_id}-"), seg
                )
            self.n_inflight_requests += 1
            try:
                route_kw = (
                    {}
                    if routes is None
                    else dict(  # only with routing replay
                        return_routed_experts=True
                    )
                )
                res = await self.client.generate(
                    list(input_ids) + out,
                    params,
                    rid=f"{key}-r{seg}",
                    sticky_key=key,
                    image_data=image_data,
                    **route_kw,
                )
            finally:
                self.n_inflight_requests -= 1
            status = (res.finish_reason or {}).get("status_code")
            if res.finish_type == "abort" and status:  # an error, not an interruption
                self.client.release(key)
                raise RolloutRequestError(
                    f"{res.server}/generate: aborted with status {status}: "
                    f"{(res.finish_reason or {}).get('message', '')}",
                    status=int(status),
                )
            if routes is not None:
                got = call_routes(res, len(input_ids) + len(out), self.route_layout)
                routes.add(*(got or (None,)))
            out += res.output_ids
            lps += res.logprobs
            vers += (
                token_versions(res, submit_version)
                if self._trust_server_version
                else [submit_version] * len(res.output_ids)
            )
            server = res.server
            if res.finish_type != "abort" or len(out) >= max_new_tokens:
                self.client.release(key)
                finish = res.finish_type if res.finish_type != "abort" else "length"
                return GenerationOutput(
                    out,
                    lps,
                    vers,
                    model_finish(finish, out, sp, self.tokenizer),
                    seg,
                    server,
                    routes.rows() if routes else None,
                )
            seg += 1
            self.n_interruptions += 1

    # ------------------------------------------------------------------ worker API
    @property
    def version(self) -> int:
        """The weight version currently on the servers."""
        return self.counter.version

    def update_weights(self, version: int, path: str, timeout: float = 600.0) -> None:
        """Stop dispatching → pause servers (in-flight requests abort with partial output) →
        load ``path`` (HF safetensors dir) on every server → continue → set ``version``;
        interrupted requests then resume automatically."""
        self._check_version(version)
        self.begin_weight_update(timeout)
        ok = False
        try:
            self.run_async(load_published(self.client, path, version)).result(timeout)
            ok = True
        finally:
            self.end_weight_update(version if ok else None, timeout)

    def _check_version(self, version: int) -> None:
        if version <= self.counter.version:
            raise ValueError(
                f"update_weights: version {version} must exceed {self.counter.version}"
            )

    def begin_weight_update(self, timeout: float = 600.0) -> None:
        """First half of an update driven from elsewhere (e.g. the trainer broadcasting over
        its own weight-update group): stop dispatching and pause the servers."""
        self.run_async(self._begin_update()).result(timeout)

    def end_weight_update(self, version: Optional[int], timeout: float = 600.0) -> None:
        """Second half: make ``version`` current (None: the update failed, keep the old one),
        continue the servers and resume dispatching (interrupted requests resubmit)."""
        if version is not None:
            self._check_version(version)
        self.run_async(self._end_update(version)).result(timeout)

    async def _begin_update(self) -> None:
        self._gate.clear()
        await self.client.pause()

    async def _end_update(self, version: Optional[int]) -> None:
        try:
            try:
                if version is not None:
                    if self._trust_server_version:
                        await self.client.set_weight_version(version)
                    self.counter.set_version(version)
            finally:
                await self.client.resume()  # never leave a server paused
        finally:
            self._gate.set()
            self._wake.set()

    def stats(self) -> dict:
        """Counters for logging (the cumulative ones reach the metrics rows through
        :mod:`areal_mega.rollout.counts`)."""
        c = self.counter
        return {
            "version": c.version,
            "accepted": c.accepted,
            "running": c.running,
            "rejected": c.rejected,
            "capacity": c.capacity(),
            "started": self.n_started,
            "finished": self.n_finished,
            "failed": self.n_failed,
            "interruptions": self.n_interruptions,
            "reward_errors": self.reward_errors,
            **self.failures.stats(),
            "buffered": len(self._finished),
            "max_running_seen": self.max_running_seen,
            **(self.workflow.stats() if hasattr(self.workflow, "stats") else {}),
        }

"""The rollout worker process: prompts -> rollout servers -> rewards -> data plane -> trainer.

    python -m areal_mega.rollout.worker --config recipes/X.yaml [key=value ...]

(normally started by ``areal_mega.launch.local``). It runs a
:class:`~areal_mega.rollout.controller.RolloutController` over the training prompts, pushes
every finished group through a :class:`~areal_mega.dataplane.TrajectorySender` to trainer
rank 0, and serves the control channel (:mod:`areal_mega.dataplane.control`) on which the
trainer orders weight updates.

Crash safety: the prompt position is written to ``<run_dir>/rollout_state.json`` (atomically)
as groups are delivered; it is the position of the oldest prompt whose group has not been
delivered, so prompts in flight at a crash are generated again. When the trainer resumes from
a checkpoint, the worker waits for the trainer's first weight update before it generates (the
servers start from the base model); it then regenerates exactly the drawn prompts whose whole
group the trainer does not hold (checkpoint ledger + journal, :mod:`areal_mega.rollout.resume`)
and counts the groups it holds as accepted, so the staleness bound holds across the restart.

Relaunched alone (``--relaunched``: ``launch.local`` restarts a killed worker while the trainer
runs on), the worker continues this run whatever ``recover`` says: it resumes from
``rollout_state.json``, brings the servers to the newest published weights (their version
becomes its current version) and generates at once (the trainer may be waiting for data). A
rollout server that comes back after a relaunch is re-synced before it gets work
(:mod:`areal_mega.rollout.relaunch`). SIGTERM stops it within ``cluster.kill_grace_s``
(exit code 143).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from areal_mega.backends.clients import client_class
from areal_mega.common.files import atomic_write
from areal_mega.common.signals import TermWatchdog
from areal_mega.config import load_config
from areal_mega.data.dataset import PromptDataset, PromptSampler, load_tokenizer
from areal_mega.dataplane.control import ControlServer
from areal_mega.dataplane.prompt_ledger import PromptLedger
from areal_mega.dataplane.transport import TrajectorySender
from areal_mega.eval.worker_hook import WorkerEvaluator
from areal_mega.inference.vl_model import checkpoint_vision_token_ids
from areal_mega.models.vlm.inputs import load_image_processor
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.counts import CountCarrier, counts_of
from areal_mega.rollout.failures import FailureRate, FailureRateExceeded, episode_failure_policy
from areal_mega.rollout.lora_sync import load_published
from areal_mega.rollout.resume import accepted_ledger, resumed_cursor
from areal_mega.rollout.routes import replay_layout
from areal_mega.rollout.server_pool import ElasticPool, ServerPoolCommands, pool_metrics
from areal_mega.run_dir import FATAL_EXIT_CODE, RunDir, checkpoint_iteration, checkpoint_meta
from areal_mega.workflow.builtin import workflow_from_config
from areal_mega.workflow.multitask import build_multitask

log = logging.getLogger("areal_mega.rollout.worker")


class PromptCursor:
    """Endless prompt items in a deterministic, resumable order (one prompt at a time)."""

    def __init__(self, dataset, seed: int, shuffle: bool, start: int = 0):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.sampler = PromptSampler(len(dataset), 1, seed=seed, shuffle=shuffle, drop_last=False)
        n = len(dataset)
        if start:
            self.sampler.load_state_dict({"epoch": start // n, "offset": start % n})
        self.drawn = start
        self._lock = threading.Lock()
        self.outstanding: set = set()
        self.delivered_upto = start

    def __iter__(self):
        while True:
            with self._lock:
                k = self.drawn
                idx = self.sampler.next_indices()[0]
                self.drawn += 1
                self.outstanding.add(k)
            # a prompt with images is encoded here, once for its whole group
            yield {**self.dataset.prompt_fields(idx), "prompt_index": k}

    def delivered(self, k: int) -> int:
        """Mark prompt ``k`` delivered; returns the resume position (oldest outstanding)."""
        with self._lock:
            self.outstanding.discard(k)
            return min(self.outstanding) if self.outstanding else self.drawn

    def at(self, start: int) -> "PromptCursor":
        """The same prompt stream from position ``start``."""
        return PromptCursor(self.dataset, self.seed, self.shuffle, start=start)


class StampedWorkflow:
    """Wraps a workflow so each trajectory carries the prompt position it came from."""

    def __init__(self, inner):
        self.inner = inner

    async def arun_episode(self, ctx, item: dict, n_samples: int) -> list:
        trajs = await self.inner.arun_episode(ctx, item, n_samples)
        for t in trajs:
            t.meta["prompt_index"] = int(item["prompt_index"])
            t.meta["group_size"] = len(trajs)  # a sample may yield several (agent calls)
        return trajs

    def stats(self) -> dict:
        """The inner workflow's counters (e.g. failed agent runs), for ``stats``."""
        return self.inner.stats() if hasattr(self.inner, "stats") else {}


class RolloutWorker:
    """The rollout side of an RL run, one per run, in its own process (``main``, started by
    ``areal_mega.launch.local``; never inside a trainer rank).

    Threads: the main thread runs :meth:`run`; the controller generates in its own thread with
    an asyncio loop and calls :meth:`_sink` from a thread pool; the control server calls
    :meth:`handle` from its own thread (one command at a time).
    """

    def __init__(self, cfg, relaunched: bool = False):
        """Set everything up from an :class:`~areal_mega.config.ExperimentConfig`; generates
        nothing yet. ``relaunched``: continue this run after a crash of the worker alone (see
        the module doc).

        Reads ``<run_dir>/rollout_state.json`` (with ``recover=auto``) for the prompt position
        and the latest trainer checkpoint under ``checkpoint.dir`` for the step to resume at;
        loads the tokenizer and the prompt dataset; connects the rollout-server client
        (``rollout.server_addrs``, must be non-empty: ``ValueError``) and the trajectory sender
        to the trainer's data endpoint; binds the control endpoint and starts answering
        commands. Creates ``logging.run_dir`` if needed.
        """

        self.cfg = cfg
        self.relaunched = relaunched
        self.paths = RunDir.from_config(cfg)
        self.run_dir = self.paths.root
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.paths.rollout_state
        start = self.drawn_before = 0
        saved: dict = {}
        if self.state_path.exists() and (cfg.recover == "auto" or relaunched):
            saved = json.loads(self.state_path.read_text())
            start = int(saved.get("next_prompt", 0))
            self.drawn_before = int(saved.get("drawn", start))
        # counters ride on delivered groups to the trainer's metrics (rollout/counts.py)
        self.counts = CountCarrier.from_state(
            lambda: counts_of(self.controller.stats() if self.controller else {}), saved
        )
        self.tokenizer = load_tokenizer(cfg.model.path)
        if cfg.data.sources:  # multi-task: per-source datasets, weights and rewards
            self.cursor, inner_workflow = build_multitask(cfg, self.tokenizer, start)
        else:
            dataset = PromptDataset.from_config(cfg.data, self.tokenizer, model_dir=cfg.model.path)
            self.cursor = PromptCursor(dataset, cfg.seed, cfg.data.shuffle, start=start)
            inner_workflow = workflow_from_config(
                cfg.rollout, run_dir=str(self.run_dir), resume=cfg.recover == "auto" or relaunched
            )
        self.make_cursor = self.cursor.at  # the same prompt stream from another position
        if not cfg.rollout.server_addrs:
            raise ValueError(
                "rollout.server_addrs is empty: the worker needs the servers' "
                "host:port list (launch.local fills it in)"
            )
        self.elastic = ElasticPool(  # the servers now: some may have joined or left
            self.paths.rollout_server_addrs(cfg.rollout.server_addrs),
            paths=self.paths,
            api_key=cfg.rollout.api_key,
            client_cls=client_class(cfg.rollout.backend),
            timeout_s=cfg.rollout.request_timeout_s,
            retries=cfg.rollout.request_retries,
            down_wait_s=cfg.cluster.server_ready_timeout_s,
        )
        self.client = self.elastic.client
        self.workflow = StampedWorkflow(inner_workflow)
        self.evaluator = WorkerEvaluator.from_config(cfg, self.tokenizer)  # None: eval off
        self.sender = TrajectorySender(
            self.paths.data_endpoint,
            secret=cfg.dataplane.secret,
            window=cfg.dataplane.sender_window,
        )
        self.controller = None
        self._ctl_lock = threading.Lock()
        self._sink_lock = threading.Lock()
        self.resume_step = self._resume_step()
        self._retired_at = None  # the checkpoint whose ledger the online journal retired
        self.stop_event = threading.Event()
        self.pool = ServerPoolCommands(
            self.elastic, lambda: self.controller, timeout_s=cfg.rollout.request_timeout_s
        )
        self.control = ControlServer(
            self.paths.control_endpoint,
            self.handle,
            secret=cfg.dataplane.secret,
            allow_remote=cfg.dataplane.allow_remote,
        ).start()

    def _resume_step(self) -> int:
        if self.cfg.recover != "auto" and not self.relaunched:
            return 0
        latest = self.paths.latest_checkpoint()
        return checkpoint_iteration(latest) if latest else 0

    def _sink(self, group: list) -> None:
        # the controller calls sinks from a thread pool; a ZMQ socket is single-threaded
        with self._sink_lock:
            self.counts.attach(group)
            for t in group:
                self.sender.send(t)
            nxt = self.cursor.delivered(int(group[0].meta["prompt_index"]))
            # durable: a torn file after a machine crash would stop the resume (an fsync per
            # delivered group is small next to generating the group); "counts*": the
            # counters delivered so far (the worker's own, continued by a relaunch) and what
            # the recent deliveries carried
            state = {
                "next_prompt": nxt,
                "drawn": self.cursor.drawn,
                "time": time.time(),
                **self.counts.state(),
            }
            atomic_write(self.state_path, json.dumps(state), durable=True)

    def start_controller(self, version: int) -> None:
        """Create and start the :class:`~areal_mega.rollout.controller.RolloutController` with
        ``version`` as the servers' current weight version (0 on a fresh run, the trainer's
        step when resuming). Its accepted-group count starts at the groups the trainer already
        holds (checkpoint + journal), so the staleness bound ``rollout.max_head_offpolicyness``
        holds across a restart. Called by :meth:`run` or, when resuming, by :meth:`handle` on
        the trainer's first weight update; sets ``self.controller``.
        """

        r = self.cfg.rollout
        # resuming or relaunched: the latest complete checkpoint now (the trainer verified
        # and loaded it, moving corrupt newer ones aside, before it sent this first version)
        # plus the journal since
        ckpt = self.paths.latest_checkpoint() if self.resume_step or self.relaunched else None
        ledger = accepted_ledger(self.paths, ckpt) if ckpt is not None else None
        if ledger is not None:  # exact: regenerate just the drawn prompts the trainer lacks
            self.cursor, redo = resumed_cursor(self.make_cursor, ledger, self.drawn_before)
            log.info(
                "resume: %d prompts generated again %s, drawing on from %d",
                len(redo),
                redo[:20],
                self.cursor.drawn,
            )
            again = self.counts.carry_again_unless(ledger.holds)
            if again:
                log.info("resume: counts of deliveries the trainer lacks carried again %s", again)
            retire = getattr(self.workflow.inner, "retire_accepted", None)
            if retire is not None:  # online: sessions the trainer holds leave the journal
                retire(ledger.accepted_prompts())
        forbidden = checkpoint_vision_token_ids(self.cfg.model.path, self.tokenizer)
        ctl = RolloutController(
            self.client,
            self.workflow,
            self.cursor,
            batch_size=r.batch_size,
            n_samples=r.n_samples,
            eta=r.max_head_offpolicyness,
            max_concurrent=r.max_concurrent,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            tokenizer=self.tokenizer,
            sink=self._sink,
            initial_version=version,
            route_layout=replay_layout(self.cfg),
            sampling_seed=self.cfg.seed if r.seeded_sampling else None,
            # a vision-language checkpoint's vision special tokens are never sampled
            forbidden_token_ids=forbidden,
            image_processor=load_image_processor(self.cfg.model.path) if forbidden else None,
            on_episode_failure=episode_failure_policy(r.on_episode_failure, r.workflow),
            failure_rate=FailureRate(
                r.failure_rate_ceiling, r.failure_window, r.failure_min_prompts
            ),
        )
        if ledger is None:  # fresh, or a checkpoint older than the prompt ledger
            ctl.counter.accepted = self.paths.accepted_samples(ckpt) // r.n_samples
        else:
            ctl.counter.accepted = ledger.n_accepted_groups()
        self.controller = ctl.start()
        log.info(
            "controller started at version %d (%d groups already accepted)",
            version,
            ctl.counter.accepted,
        )

    def handle(self, msg: dict) -> dict:
        """Answer one control command from trainer rank 0; runs on the control server's thread.

        ``msg["cmd"]``:

        - ``ping`` -> ``{}``; ``stats`` -> the controller's statistics (``{"started": 0}``
          before it exists);
        - ``update_weights`` (``version``, ``path``: an HF safetensors directory) -> pause the
          servers, load ``path``, continue at ``version`` (``{"version", "seconds"}`` and the
          ``rollout/*`` server metrics, also in ``end_update``'s answer); when no
          controller runs yet (resuming) the servers load directly and the controller starts;
        - ``begin_update`` / ``end_update`` (``version``) -> the two halves of an update the
          trainer broadcasts itself: stop dispatching and pause (answering the servers its
          group must hold, ``servers``), then make ``version`` current and continue (or, when
          resuming, set the servers' version and start the controller);
        - ``servers`` / ``add_server`` / ``remove_server``: elastic rollout
          (:class:`~areal_mega.rollout.server_pool.ServerPoolCommands`);
        - ``evaluate`` (``version``) -> ``{"version", "metrics"}``: the evaluation set at the
          servers' current weights (:mod:`areal_mega.eval.worker_hook`; needs ``eval.*``).

        Returns the reply fields; raises ``FileNotFoundError`` for a missing weights directory
        and ``ValueError`` for an unknown command (the control server turns both into an error
        reply).
        """
        cmd = msg["cmd"]
        if cmd == "ping":
            return {}
        if cmd == "stats":
            return {
                **(self.controller.stats() if self.controller else {"started": 0}),
                **self.elastic.pool_stats(),
            }
        if cmd in self.pool.COMMANDS:  # elastic rollout: servers join / leave
            with self._ctl_lock:
                return self.pool.handle(msg)
        if cmd == "update_weights":
            version, path = int(msg["version"]), str(msg["path"])
            if not Path(path).is_dir():
                raise FileNotFoundError(f"weights directory {path!r} does not exist")
            t0 = time.time()
            with self._ctl_lock:
                if self.controller is not None and version == self.controller.version:
                    return {"version": version, "seconds": 0.0}  # a resent request: done
                if self.controller is None:  # resuming: load, then start generating
                    asyncio.run(self._load_directly(path, version))
                    self.start_controller(version)
                else:
                    self.controller.update_weights(version, path=path)
                self._retire_online()
            return {
                "version": version,
                "seconds": time.time() - t0,
                **pool_metrics(self.elastic.pool_stats()),
            }
        if cmd == "begin_update":  # the trainer broadcasts the weights itself (bucketed)
            with self._ctl_lock:
                if self.controller is not None:
                    self.controller.begin_weight_update()
                return self.pool.begin_update()  # the servers the trainer's group must hold
        if cmd == "end_update":
            version = int(msg["version"])
            with self._ctl_lock:
                if self.controller is not None and version == self.controller.version:
                    return {"version": version}  # a resent request: done
                if self.controller is None:  # resuming: the servers hold the weights now
                    asyncio.run(self._set_version(version))
                    self.start_controller(version)
                else:
                    self.controller.end_weight_update(version)
                self._retire_online()
                self.pool.end_update()  # servers that joined the group take work
            return {"version": version, **pool_metrics(self.elastic.pool_stats())}
        if cmd == "evaluate" and self.evaluator is not None:
            return self.evaluator.run(
                int(msg["version"]),
                self.controller,
                lambda: self.client.sibling(self.client.dispatchable()),
            )
        raise ValueError(
            f"unknown command {cmd!r}; expected ping, stats, update_weights, "
            "begin_update, end_update, servers, add_server, remove_server or "
            "evaluate (with eval.every_steps > 0)"
        )

    def _retire_online(self) -> None:
        """A newer trainer checkpoint: the online gateway may retire from its journal the
        sessions of the prompts that checkpoint's ledger holds (they are never generated
        again)."""
        retire = getattr(self.workflow.inner, "retire_accepted_later", None)
        if retire is None:
            return
        ckpt = self.paths.latest_checkpoint()
        if ckpt is None or ckpt == self._retired_at:
            return
        self._retired_at = ckpt
        state = checkpoint_meta(ckpt).get("extra", {}).get("accepted_prompts")
        if state is not None:
            retire(PromptLedger(state).accepted_prompts())

    async def _set_version(self, version: int) -> None:
        c = self.client.sibling(self.client.addrs)
        try:
            await c.set_weight_version(version)
        finally:
            await c.close()

    async def _load_directly(self, path: str, version: int) -> None:
        c = self.client.sibling(self.client.addrs)
        try:
            await load_published(c, path, version)  # full weights or a LoRA adapter
            self.client.lora_name = c.lora_name
            await c.resume()  # a killed predecessor may have left the servers paused
        finally:
            await c.close()

    def run(self) -> None:
        """Main loop of the worker process: start generating at version 0 (fresh run) or wait
        for the trainer's first weight update (resuming), then block until ``stop_event`` is
        set (SIGTERM in ``main``). Raises ``RuntimeError`` when the controller reports an error,
        so the process exits non-zero (under ``launch.local`` that ends the run; a relaunched
        trainer restarts the worker with it)."""
        if self.relaunched:
            self._continue_run()
        elif self.resume_step == 0:
            self.start_controller(0)
        else:
            log.info("resuming: waiting for the trainer's weights (step %d)", self.resume_step)
        check = None
        while not self.stop_event.wait(1.0):
            if self.controller is not None:
                self.controller.raise_if_failed()
                # a relaunched server is re-synced and used again (generate only looks when
                # no server is left)
                if self.elastic.probe_due() and (check is None or check.done()):
                    check = self.controller.run_async(self.client.check_health(2.0))

    def _continue_run(self) -> None:
        """Relaunched alone: bring the servers to the newest published weights and generate
        at their version at once (unless a resent weight update got here first)."""
        with self._ctl_lock:
            if self.controller is not None:
                return
            version = asyncio.run(self._sync_servers()) or 0
            log.info(
                "relaunched: continuing at version %d from prompt %d", version, self.cursor.drawn
            )
            self.start_controller(version)

    async def _sync_servers(self):
        try:
            return await self.elastic.sync_all()
        finally:
            await self.client.close()  # the controller's loop opens its own session

    def close(self, budget_s: float = 15.0) -> None:
        """Stop the control server, the controller and the sender (letting queued trajectories
        go out) within about ``budget_s`` seconds. A sink blocked on a full data-plane window
        keeps the sender: it is then not flushed (the prompt position was not advanced past
        those groups, so nothing accepted is lost). Called once by ``main`` on the way out."""
        # stop answering first: a command arriving (or in flight) while the controller stops
        # would be answered with an error and end the trainer; unanswered, the trainer's link
        # sees the disconnect and sends it again to the relaunched worker
        self.control.close()
        if self.controller is not None:
            self.controller.stop(timeout=max(0.5, 0.4 * budget_s))
        if self._sink_lock.acquire(timeout=max(0.2, 0.1 * budget_s)):
            try:
                self.sender.close(linger_s=max(0.5, 0.3 * budget_s))
            finally:
                self._sink_lock.release()
        else:
            log.warning("a delivery is blocked on the trainer; exiting without flushing")


def main(argv=None) -> None:
    """CLI entry point. SIGTERM (before or after set-up) stops the worker within
    ``cluster.kill_grace_s`` and exits 143; the process ends with ``os._exit`` so that no
    thread blocked on the trainer (a delivery waiting for credit) can hold it up."""

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config")
    p.add_argument(
        "--relaunched",
        action="store_true",
        help="continue this run after the worker alone crashed (launch.local)",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout-worker %(message)s")
    holder: list = []

    def on_term():
        if not holder:  # still setting up: nothing to flush yet
            os._exit(128 + signal.SIGTERM)
        holder[0].stop_event.set()

    # heard on a thread of its own, so a stuck main thread cannot hold SIGTERM up
    watchdog = TermWatchdog(on_term).install()
    rc, grace = 0, 10.0
    try:
        cfg = load_config(args.config, args.overrides)
        grace = cfg.cluster.kill_grace_s
        watchdog.exit_after_s = 0.9 * grace
        holder.append(RolloutWorker(cfg, relaunched=args.relaunched))
        holder[0].run()
        if holder[0].stop_event.is_set():
            rc = 128 + signal.SIGTERM
            log.info("SIGTERM: stopping")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        rc = 130
    except BaseException as e:  # noqa: BLE001 - reported, then the hard exit below
        rc = 1
        if holder and isinstance(e.__cause__, FailureRateExceeded):  # no relaunch cures it
            log.error("error: %s", e)  # one line; a traceback would add nothing
            holder[0].paths.write_fatal(f"rollout worker: {e.__cause__}")
            rc = FATAL_EXIT_CODE
        else:
            log.exception("rollout worker failed")
    finally:
        try:
            if holder:
                holder[0].close(budget_s=0.7 * grace)
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)


if __name__ == "__main__":
    main()

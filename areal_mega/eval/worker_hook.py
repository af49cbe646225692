"""Evaluation during training, on the rollout worker's side (the ``evaluate`` control
command; the trainer's side is :mod:`areal_mega.train.evaluation`).

The trainer asks for an evaluation right after it published the weights of ``version`` and
waits for the answer, so no weight update can happen meanwhile: every evaluation request is
generated at exactly that version. The requests go to the same servers as training (through
the worker's client, on the controller's event loop) but never through the controller's
accounting: they do not count towards the staleness bound and nothing reaches the data plane.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from typing import Callable, Optional

from areal_mega.data.sources import resolve_sources
from areal_mega.data.vision_prompts import VisionPrompts
from areal_mega.eval.runner import evaluate, load_eval_items
from areal_mega.eval.scores import flat_metrics, summarize
from areal_mega.rewards import load_reward_fn

log = logging.getLogger(__name__)


class WorkerEvaluator:
    """The evaluation set (loaded once), its reward function and sampling settings."""

    def __init__(
        self,
        items: list,
        tokenizer,
        reward_fn: Callable,
        *,
        n_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        max_concurrent: int,
        pass_threshold: float,
        timeout_s: float,
        reward_fns: Optional[dict] = None,
        n_sample_groups: int = 0,
    ):
        self.items, self.tokenizer, self.reward_fn = items, tokenizer, reward_fn
        self.reward_fns = dict(reward_fns or {})  # source name -> its own reward function
        self.settings = dict(
            n_samples=n_samples,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            max_concurrent=max_concurrent,
        )
        self.pass_threshold = pass_threshold
        self.timeout_s = timeout_s
        self.n_sample_groups = n_sample_groups  # items whose completions go to the trainer

    @classmethod
    def from_config(cls, cfg, tokenizer) -> Optional["WorkerEvaluator"]:
        """From ``cfg.eval`` (files read with the ``data.*`` keys); None when evaluation is
        off (``eval.every_steps`` 0 or no ``eval.data``). The reward: ``eval.reward_fn`` for
        every item; when empty, an item whose source (its ``source`` field or file stem) names
        one of ``data.sources`` is scored like that source in training (its ``reward_fn`` and
        ``reward_kwargs``), any other with ``rollout.reward_fn``. Raises ``DataError`` for a
        bad file and ``ValueError`` for a bad reward path, so a misconfigured run fails at
        start."""

        e, d, r = cfg.eval, cfg.data, cfg.rollout
        if not e.every_steps or not e.data:
            return None
        items = load_eval_items(
            e.data,
            tokenizer,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            apply_chat_template=d.apply_chat_template,
            max_prompt_len=d.max_prompt_len,
            fmt=d.format,
            vision=VisionPrompts.from_config(d, cfg.model.path),
        )
        log.info("evaluation set: %d prompts from %s", len(items), e.data)
        per_source = {}
        if not e.reward_fn and d.sources:
            for spec in resolve_sources(d, r.reward_fn):
                fn = load_reward_fn(spec.reward_fn)
                per_source[spec.name] = (
                    functools.partial(fn, **spec.reward_kwargs) if spec.reward_kwargs else fn
                )
        return cls(
            items,
            tokenizer,
            load_reward_fn(e.reward_fn or r.reward_fn),
            n_samples=e.n_samples,
            temperature=e.temperature,
            top_p=e.top_p,
            max_new_tokens=e.max_new_tokens or r.max_new_tokens,
            max_concurrent=r.max_concurrent,
            pass_threshold=e.pass_threshold,
            timeout_s=r.request_timeout_s,
            reward_fns=per_source,
            n_sample_groups=cfg.logging.log_samples_groups if cfg.logging.log_samples_every else 0,
        )

    async def _records(self, client, version: int) -> list:
        return await evaluate(
            client,
            self.items,
            self.tokenizer,
            self.reward_fn,
            rid_prefix=f"eval-v{version}-{uuid.uuid4().hex[:6]}",
            reward_fns=self.reward_fns,
            **self.settings,
        )

    def run(self, version: int, controller, make_client: Callable) -> dict:
        """Evaluate at ``version`` and return ``{"version", "metrics", "samples"}`` (``eval/*``
        scalars, :func:`areal_mega.eval.scores.flat_metrics`, plus ``eval/seconds``; the
        completions of the first ``n_sample_groups`` items, :func:`eval_sample_rows`). With a
        running
        ``controller`` its client and loop are used and its version must be ``version``
        (``ValueError`` otherwise: the servers would serve other weights); without one (the
        worker has not started generating yet) a client from ``make_client()`` is used."""

        t0 = time.time()
        if controller is not None:
            if controller.version != version:
                raise ValueError(
                    f"evaluate: the servers serve version {controller.version}, not {version}"
                )
            records = controller.run_async(self._records(controller.client, version)).result(
                self.timeout_s
            )
        else:

            async def standalone():
                client = make_client()
                try:
                    return await self._records(client, version)
                finally:
                    await client.close()

            records = asyncio.run(standalone())
        metrics = flat_metrics(summarize(records, self.pass_threshold))
        metrics["eval/seconds"] = time.time() - t0
        samples = eval_sample_rows(records[: self.n_sample_groups], version)
        log.info(
            "evaluation at version %d: pass@1 %.4f (%d prompts, %.1f s)",
            version,
            metrics["eval/pass@1"],
            len(records),
            metrics["eval/seconds"],
        )
        return {"version": version, "metrics": metrics, "samples": samples}


def eval_sample_rows(records: list, version: int) -> list:
    """The samples-log rows (:mod:`areal_mega.tracking.samples`) of evaluation records: one
    per completion, the item as its group."""
    return [
        {
            "group_id": f"eval-{r['source']}-{r['index']}",
            "sample_id": f"eval-{r['source']}-{r['index']}-{j}",
            "prompt": r["prompt"],
            "completion": text,
            "reward": float(r["rewards"][j]),
            "advantage": None,
            "response_len": int(r["response_lens"][j]),
            "finish_reason": r["finish_reasons"][j],
            "version_min": version,
            "version_max": version,
        }
        for r in records
        for j, text in enumerate(r["completions"])
    ]

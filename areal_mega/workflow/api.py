"""The Workflow API: how a user writes an episode (see ``docs/workflows.md``).

An episode is an async function run once per sample of a prompt group::

    async def my_episode(ctx: SampleContext, item: dict, **workflow_kwargs) -> float | list:
        ...

It returns either a reward (float): the trajectories are then built from the calls it made
through ``ctx.client`` (the OpenAI-compatible client, see
:func:`areal_mega.workflow.episode_export.export_completions`), or a list of
:class:`~areal_mega.dataplane.Trajectory` it built itself with ``ctx.new_sequence`` /
``ctx.trajectory``. A class works too: subclass :class:`EpisodeWorkflow` and implement
``episode(self, ctx, item)``. ``rollout.workflow`` names one (``rlvr``, ``multi_turn``,
``package.module:Name`` or ``path/to/file.py:Name``); ``rollout.workflow_kwargs`` are passed
to it (as keyword arguments of the function, or of the class's constructor).

:class:`SampleContext` is the stable surface: ``generate`` (interruptible; tokens, logprobs and
per-token weight versions), ``tokenizer``, ``client`` (``chat.completions.create`` /
``completions.create``), ``openai_endpoint()`` (base URL and a key for this sample, for
programs outside this process), ``reward`` / ``run_blocking`` (off the event loop),
``new_sequence`` / ``trajectory`` / ``prompt_ids``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from areal_mega.dataplane import Trajectory
from areal_mega.workflow.episode_export import export_completions
from areal_mega.workflow.openai_client import OpenAICompatClient
from areal_mega.workflow.openai_server import close_session, close_shared_server, shared_server
from areal_mega.workflow.tokens import TokenSeq, prompt_ids

log = logging.getLogger(__name__)


class EpisodeFailed(RuntimeError):
    """Raised when every sample of a group failed (nothing to train on); the controller then
    retries or drops the prompt (``rollout.on_episode_failure``)."""


@dataclass
class WorkflowSettings:
    """Run-wide settings a workflow sees (from ``rollout.*``)."""

    max_new_tokens: int = 512
    openai_port: int = 0  # the OpenAI-compatible HTTP endpoint's port (0: any free)
    turn_discount: float = 1.0  # per-completion reward discount when calls do not chain


class SampleContext:
    """What one sample's episode sees. Built by :class:`EpisodeWorkflow` from the controller's
    group context (``group``: :class:`~areal_mega.rollout.controller.GroupContext`)."""

    def __init__(self, group, item: dict, index: int, settings: WorkflowSettings):
        self.group = group
        self.item = item
        self.sample_index = index
        self.sample_id = group.sample_id(index)
        self.group_id = group.group_id
        self.tokenizer = group.tokenizer
        # a vision-language policy's image processor (None: a text policy)
        self.image_processor = getattr(group, "image_processor", None)
        self.settings = settings
        self.max_new_tokens = settings.max_new_tokens
        self._turns = 0
        self._client = None
        self.failed: Optional[str] = None  # set by a workflow: why this sample failed
        self.image_data: Optional[list] = None  # the latest generate call's images, as sent

    async def generate(
        self,
        input_ids: list,
        max_new_tokens: Optional[int] = None,
        image_data: Optional[list] = None,
        **sampling,
    ):
        """Interruptible generation of up to ``max_new_tokens`` (default
        ``rollout.max_new_tokens``) after ``input_ids``. Returns a
        :class:`~areal_mega.rollout.controller.GenerationOutput`: ``output_ids``,
        ``logprobs``, ``versions`` (per token, exact across weight updates), ``finish_reason``
        (stop | length | abort), ``n_interruptions``, ``server``. ``sampling``: SGLang
        sampling parameters (``temperature``, ``top_p``, ``stop``, ``sampling_seed``...).
        ``image_data``: the prompt's images (one string each, in order: a
        ``data:image/png;base64,`` URL, raw base64 or a path the servers can read) when
        ``input_ids`` is a processor-expanded prompt with image placeholders; sent again with
        the partial output when a weight update interrupts the request; kept as
        :attr:`image_data` for the sample's trajectory (:meth:`trajectory`)."""
        turn, self._turns = self._turns, self._turns + 1
        if image_data:
            self.image_data = list(image_data)
        n = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        return await self.group.generate(
            list(input_ids),
            n,
            sample_index=self.sample_index,
            turn=turn,
            image_data=image_data,
            **sampling,
        )

    @property
    def client(self):
        """The in-process OpenAI-compatible client of this sample
        (:class:`~areal_mega.workflow.openai_client.OpenAICompatClient`); every completion it
        returns is recorded with its exact tokens for the trajectory."""
        if self._client is None:
            self._client = OpenAICompatClient(
                self.generate,
                self.tokenizer,
                default_max_tokens=self.max_new_tokens,
                image_processor=self.image_processor,
            )
        return self._client

    async def openai_endpoint(self) -> tuple:
        """``(base_url, api_key)`` of the OpenAI-compatible HTTP endpoint for this sample (the
        server starts on first use); calls made with this key are recorded on ``client``."""

        srv = await shared_server(self.settings.openai_port)
        self.group.at_close(close_shared_server)
        return srv.base_url, srv.open_session(self.client)

    def close_endpoint(self, api_key: str) -> None:
        """Forget the key given by :meth:`openai_endpoint` (later calls get 401)."""

        close_session(api_key)

    def prompt_ids(self, item: Optional[dict] = None, apply_chat_template: bool = True) -> list:
        """Token ids of a prompt item (``input_ids``, else the chat-templated ``prompt``)."""
        return prompt_ids(self.tokenizer, self.item if item is None else item, apply_chat_template)

    @staticmethod
    def new_sequence(context_ids=()) -> TokenSeq:
        """A growing token sequence (``add_context`` / ``add_generated``)."""
        seq = TokenSeq()
        seq.add_context(context_ids)
        return seq

    def trajectory(
        self,
        seq: TokenSeq,
        reward: float,
        prompt_len: int,
        finish_reason: str,
        suffix: str = "",
        server_id: str = "",
        meta: Optional[dict] = None,
        multimodal: Optional[dict] = None,
    ):
        """Freeze ``seq`` into this sample's :class:`Trajectory` (``suffix`` makes the id
        unique when one sample yields several trajectories); ``multimodal``: the prompt's
        images (``pixel_values`` / ``image_grid_thw``, :mod:`areal_mega.dataplane.multimodal`).
        With images, ``meta["image_data"]`` is set (unless given) to the same images as the
        sample's latest ``generate`` call with images sent them (:attr:`image_data`), what a
        served teacher scores the trajectory with."""
        if multimodal and self.image_data and "image_data" not in (meta or {}):
            meta = {**(meta or {}), "image_data": list(self.image_data)}
        return seq.to_trajectory(
            reward=reward,
            sample_id=self.sample_id + suffix,
            group_id=self.group_id,
            prompt_len=prompt_len,
            finish_reason=finish_reason,
            server_id=server_id,
            meta=meta,
            multimodal=multimodal,
        )

    async def reward(self, fn, *args, **kw) -> float:
        """Run a (blocking) reward function off the event loop; an error gives 0 (logged)."""
        return await self.group.reward(fn, *args, **kw)

    async def run_blocking(self, fn, *args, **kw):
        """Run ``fn(*args, **kw)`` in the controller's thread pool."""
        return await self.group.run_blocking(fn, *args, **kw)


class EpisodeWorkflow:
    """Base of every workflow: runs :meth:`episode` once per sample of a group, concurrently,
    and turns each result into trajectories. Subclasses implement :meth:`episode`."""

    settings = WorkflowSettings()

    async def episode(self, ctx: SampleContext, item: dict):
        """One sample: return a reward (trajectories from ``ctx.client``'s calls) or a list of
        trajectories."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Counters of this workflow, merged into the controller's ``stats()``."""
        return {}

    async def arun_episode(self, ctx, item: dict, n_samples: int) -> list:
        """The controller's entry point: all ``n_samples`` samples of one prompt group."""
        samples = [SampleContext(ctx, item, j, self.settings) for j in range(n_samples)]
        tasks = [asyncio.ensure_future(self.episode(s, item)) for s in samples]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # one sample failed (or we are cancelled): stop the others
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        out: list = []
        for s, res in zip(samples, results):
            out += self._to_trajectories(s, res)
        if not out:
            reasons = "; ".join(sorted({s.failed or "no trajectory" for s in samples}))
            raise EpisodeFailed(f"every sample of group {ctx.group_id} failed: {reasons}")
        return out

    def _to_trajectories(self, s: SampleContext, res) -> list:
        if s.failed is not None:
            return []
        if isinstance(res, Trajectory):
            return [res]
        if isinstance(res, (list, tuple)):
            if not all(isinstance(t, Trajectory) for t in res):
                raise TypeError(
                    f"{type(self).__name__}.episode returned a list that is not all Trajectory"
                )
            return list(res)
        if isinstance(res, (int, float)) and not isinstance(res, bool):
            return export_completions(
                s, float(res), s.client.records, discount=self.settings.turn_discount
            )
        raise TypeError(
            f"{type(self).__name__}.episode returned {type(res).__name__}; "
            "expected a reward (float) or a list of Trajectory"
        )


class FunctionWorkflow(EpisodeWorkflow):
    """A workflow from an async function ``fn(ctx, item, **kwargs)``."""

    def __init__(self, fn: Callable, kwargs: Optional[dict] = None):
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"workflow function {getattr(fn, '__name__', fn)!r} must be `async def`"
            )
        self.fn, self.kwargs = fn, dict(kwargs or {})

    async def episode(self, ctx: SampleContext, item: dict):
        return await self.fn(ctx, item, **self.kwargs)


def build_workflow(obj: Any, kwargs: Optional[dict], settings: WorkflowSettings):
    """An :class:`EpisodeWorkflow` from a user object: an async function, an
    :class:`EpisodeWorkflow` subclass (constructed with ``kwargs``) or an instance."""
    kwargs = dict(kwargs or {})
    if inspect.isclass(obj):
        try:
            wf = obj(**kwargs)
        except TypeError as e:
            raise ValueError(
                f"rollout.workflow_kwargs {sorted(kwargs)} do not fit {obj.__name__}: {e}"
            ) from e
    elif inspect.iscoroutinefunction(obj):
        wf = FunctionWorkflow(obj, kwargs)
    else:
        wf = obj
        if kwargs:
            raise ValueError("rollout.workflow_kwargs given for a workflow instance")
    if not hasattr(wf, "arun_episode"):
        raise ValueError(
            f"rollout.workflow: {obj!r} is neither an async episode function nor an EpisodeWorkflow"
        )
    if isinstance(wf, EpisodeWorkflow):
        wf.settings = settings
    return wf

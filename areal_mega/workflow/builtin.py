"""The built-in workflows, written against the Workflow API
(:mod:`areal_mega.workflow.api`): single-turn RLVR and multi-turn with environment
turns. ``rollout.workflow`` picks one by name (``rlvr`` | ``multi_turn``) or loads a user's
(``package.module:Name`` | ``path/to/file.py:Name``) with ``rollout.workflow_kwargs``.

Prompt items are dicts with ``prompt`` (text) or ``input_ids``, and ``answer`` (for the reward).
A prompt with images (:meth:`~areal_mega.data.dataset.PromptDataset.prompt_fields`) also has
``multimodal`` (its images' patches and grids, for the trainer) and ``image_data`` (the same
images for the rollout server); its ``input_ids`` are image-expanded. Both are encoded once per
prompt, shared by the samples of its group: every generation of a sample sends ``image_data``
and every trajectory carries ``multimodal``.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from areal_mega.common.loading import load_object
from areal_mega.rewards import load_reward_fn
from areal_mega.workflow.api import EpisodeWorkflow, SampleContext, WorkflowSettings, build_workflow
from areal_mega.workflow.online_gateway import OnlineWorkflow
from areal_mega.workflow.tokens import TokenSeq, prompt_ids

__all__ = [
    "RLVRWorkflow",
    "MultiTurnWorkflow",
    "RetryEnvironment",
    "TokenSeq",
    "image_inputs",
    "prompt_ids",
    "workflow_from_config",
]


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def image_inputs(item: dict) -> tuple:
    """``(generate kwargs, trajectory kwargs)`` of a prompt item's images: ``image_data`` for
    :meth:`SampleContext.generate`, ``multimodal`` for :meth:`SampleContext.trajectory`; both
    empty for a text prompt."""
    if not item.get("image_data"):
        return {}, {}
    if not item.get("multimodal"):
        raise ValueError(
            "a prompt item with image_data needs its multimodal (pixel_values, "
            "image_grid_thw) for the trainer; build items with PromptDataset.prompt_fields"
        )
    return {"image_data": list(item["image_data"])}, {"multimodal": item["multimodal"]}


class RLVRWorkflow(EpisodeWorkflow):
    """Single turn: each sample is one completion of the prompt, scored by ``reward_fn``
    (``fn(prompt, completion, answer, finish_reason=..., **item_extras)``)."""

    def __init__(
        self,
        reward_fn,
        max_new_tokens: int,
        apply_chat_template: bool = True,
        stop_token_ids: Optional[list] = None,
    ):
        self.reward_fn = reward_fn
        self.max_new_tokens = max_new_tokens
        self.apply_chat_template = apply_chat_template
        self.stop_token_ids = stop_token_ids

    async def episode(self, ctx: SampleContext, item: dict) -> list:
        ids = ctx.prompt_ids(item, self.apply_chat_template)
        gen_images, traj_images = image_inputs(item)
        gen = await ctx.generate(
            ids, self.max_new_tokens, stop_token_ids=self.stop_token_ids, **gen_images
        )
        seq = ctx.new_sequence(ids)
        seq.add_generated(gen.output_ids, gen.logprobs, gen.versions, gen.routed_experts)
        text = _decode(ctx.tokenizer, gen.output_ids)
        r = await ctx.reward(
            self.reward_fn,
            item.get("prompt", ""),
            text,
            item.get("answer"),
            finish_reason=gen.finish_reason,
        )
        return [
            ctx.trajectory(
                seq,
                r,
                len(ids),
                gen.finish_reason,
                server_id=gen.server,
                meta={"n_interruptions": gen.n_interruptions, "completion": text},
                **traj_images,
            )
        ]


class Environment(Protocol):
    """A multi-turn environment: one instance per sample."""

    def reset(self, item: dict) -> None: ...

    def step(self, completion: str) -> tuple:
        """-> (observation text or None, reward, done)."""
        ...


class RetryEnvironment:
    """Tool/feedback turns: score each answer with ``reward_fn``; a wrong one gets
    ``feedback`` as an environment turn and another try. Reward: the last score times
    ``discount ** (turns - 1)``."""

    def __init__(self, reward_fn, feedback: str = "\nWrong, try again:\n", discount: float = 0.9):
        self.reward_fn, self.feedback, self.discount = reward_fn, feedback, discount
        self.item: dict = {}
        self.turn = 0

    def reset(self, item: dict) -> None:
        self.item, self.turn = item, 0

    def step(self, completion: str, finish_reason: str = "stop") -> tuple:
        self.turn += 1
        r = float(
            self.reward_fn(
                self.item.get("prompt", ""),
                completion,
                self.item.get("answer"),
                finish_reason=finish_reason,
            )
        )
        if r > 0:
            return None, r * self.discount ** (self.turn - 1), True
        return self.feedback, 0.0, False


class MultiTurnWorkflow(EpisodeWorkflow):
    """Alternating policy and environment turns in one token sequence. Environment tokens are
    context (loss mask 0, version -1). Stops when the environment says done, after
    ``max_turns`` policy turns, or when the token budget ``max_total_tokens`` is used up."""

    def __init__(
        self,
        env_factory,
        max_new_tokens: int,
        max_turns: int = 3,
        max_total_tokens: int = 512,
        apply_chat_template: bool = True,
    ):
        self.env_factory = env_factory
        self.max_new_tokens = max_new_tokens
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.apply_chat_template = apply_chat_template

    async def episode(self, ctx: SampleContext, item: dict) -> list:
        ids = ctx.prompt_ids(item, self.apply_chat_template)
        gen_images, traj_images = image_inputs(item)
        env = self.env_factory()
        env.reset(item)
        seq = ctx.new_sequence(ids)
        reward, finish, servers, interrupts = 0.0, "length", [], 0
        for turn in range(self.max_turns):
            budget = min(self.max_new_tokens, self.max_total_tokens - len(seq.input_ids))
            if budget <= 0:
                break
            gen = await ctx.generate(seq.input_ids, budget, **gen_images)
            seq.add_generated(gen.output_ids, gen.logprobs, gen.versions, gen.routed_experts)
            finish, interrupts = gen.finish_reason, interrupts + gen.n_interruptions
            servers.append(gen.server)
            text = _decode(ctx.tokenizer, gen.output_ids)
            obs, reward, done = await ctx.run_blocking(env.step, text, gen.finish_reason)
            if done or obs is None or turn == self.max_turns - 1:
                break
            seq.add_context(ctx.tokenizer(obs, add_special_tokens=False)["input_ids"])
        return [
            ctx.trajectory(
                seq,
                reward,
                len(ids),
                finish,
                server_id=servers[-1] if servers else "",
                meta={"turns": len(servers), "n_interruptions": interrupts},
                **traj_images,
            )
        ]


def workflow_from_config(
    rollout_cfg,
    reward_fn=None,
    env_factory=None,
    run_dir: Optional[str] = None,
    resume: bool = False,
) -> Any:
    """Build the workflow named by ``rollout.workflow``: ``rlvr`` | ``multi_turn`` (with
    ``rollout.reward_fn``), ``online`` (the agent gateway of ``rollout.online``, which writes
    ``online_gateway.json`` and its session journal into ``run_dir``, continuing the journal
    when ``resume``), or a user's ``package.module:Name`` | ``path/to/file.py:Name``
    built with ``rollout.workflow_kwargs`` (see :func:`workflow_api.build_workflow`)."""

    settings = WorkflowSettings(
        max_new_tokens=rollout_cfg.max_new_tokens,
        openai_port=rollout_cfg.openai_port,
        turn_discount=rollout_cfg.turn_discount,
    )
    name, kwargs = rollout_cfg.workflow, dict(rollout_cfg.workflow_kwargs or {})
    if name == "online":
        if kwargs:
            raise ValueError(
                "rollout.workflow_kwargs: the online workflow takes none "
                "(its keys are rollout.online.*)"
            )
        wf = OnlineWorkflow(
            rollout_cfg.online, rollout_cfg.n_samples, run_dir=run_dir, resume=resume
        )
        wf.settings = settings
        return wf
    if name in ("rlvr", "multi_turn"):
        fn = reward_fn or load_reward_fn(rollout_cfg.reward_fn)
        if name == "rlvr":
            wf = RLVRWorkflow(fn, rollout_cfg.max_new_tokens, **kwargs)
        else:
            wf = MultiTurnWorkflow(
                env_factory or (lambda: RetryEnvironment(fn)),
                rollout_cfg.max_new_tokens,
                **{"max_total_tokens": 4 * rollout_cfg.max_new_tokens, **kwargs},
            )
        wf.settings = settings
        return wf
    return build_workflow(load_object(name, "rollout.workflow"), kwargs, settings)

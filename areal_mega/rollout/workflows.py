"""Episode workflows: single-turn RLVR and multi-turn with environment turns.

A workflow is an object with ``async arun_episode(ctx, item, n_samples) -> list[Trajectory]``;
``ctx`` is the controller's :class:`~areal_mega.rollout.controller.EpisodeContext`
(interruptible ``generate``, ``reward`` off the event loop, ``tokenizer``).
Prompt items are dicts with ``prompt`` (text) or ``input_ids``, and ``answer`` (for the reward).

Per-token fields follow the data-plane contract: ``loss_mask`` 1 only on generated tokens;
``logprobs`` 0 and ``versions`` -1 on prompt and environment tokens.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

from areal_mega.dataplane import Trajectory


@dataclass
class TokenSeq:
    """Growing per-token arrays of one sample."""
    input_ids: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)

    def add_context(self, ids) -> None:
        """Prompt / environment tokens: not trained on."""
        ids = list(ids)
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, ids, logprobs, versions) -> None:
        """Policy tokens with their behaviour logprobs and weight versions."""
        assert len(ids) == len(logprobs) == len(versions)
        self.input_ids += list(ids)
        self.loss_mask += [1] * len(ids)
        self.logprobs += list(logprobs)
        self.versions += list(versions)

    def to_trajectory(self, *, reward: float, sample_id: str, group_id: str, prompt_len: int,
                      finish_reason: str, server_id: str = "", meta: Optional[dict] = None):
        """Freeze into a :class:`Trajectory` with the data-plane dtypes."""
        return Trajectory(
            input_ids=np.asarray(self.input_ids, dtype=np.int32),
            loss_mask=np.asarray(self.loss_mask, dtype=np.uint8),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            reward=float(reward), sample_id=sample_id, group_id=group_id,
            prompt_len=int(prompt_len), finish_reason=finish_reason, created_at=time.time(),
            server_id=server_id, meta=dict(meta or {}))


def prompt_ids(tokenizer, item: dict, apply_chat_template: bool = True) -> list:
    """Token ids of a prompt item (``input_ids`` as given, else the chat-templated ``prompt``)."""
    if item.get("input_ids") is not None:
        return [int(i) for i in item["input_ids"]]
    if tokenizer is None:
        raise ValueError("prompt item has no input_ids and no tokenizer was given")
    text = item.get("prompt")
    if not isinstance(text, str):
        raise ValueError(f"prompt item needs 'prompt' (str) or 'input_ids': {item!r:.200}")
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


class Workflow(Protocol):
    async def arun_episode(self, ctx, item: dict, n_samples: int) -> list: ...


class RLVRWorkflow:
    """Single turn: ``n_samples`` completions of one prompt, each scored by ``reward_fn``
    (``fn(prompt, completion, answer, finish_reason=..., **item_extras)``)."""

    def __init__(self, reward_fn, max_new_tokens: int, apply_chat_template: bool = True,
                 stop_token_ids: Optional[list] = None):
        self.reward_fn = reward_fn
        self.max_new_tokens = max_new_tokens
        self.apply_chat_template = apply_chat_template
        self.stop_token_ids = stop_token_ids

    async def arun_episode(self, ctx, item: dict, n_samples: int) -> list:
        ids = prompt_ids(ctx.tokenizer, item, self.apply_chat_template)

        async def one(j: int):
            gen = await ctx.generate(ids, self.max_new_tokens, sample_index=j,
                                     stop_token_ids=self.stop_token_ids)
            seq = TokenSeq()
            seq.add_context(ids)
            seq.add_generated(gen.output_ids, gen.logprobs, gen.versions)
            text = _decode(ctx.tokenizer, gen.output_ids)
            r = await ctx.reward(self.reward_fn, item.get("prompt", ""), text,
                                 item.get("answer"), finish_reason=gen.finish_reason)
            return seq.to_trajectory(
                reward=r, sample_id=ctx.sample_id(j), group_id=ctx.group_id,
                prompt_len=len(ids), finish_reason=gen.finish_reason, server_id=gen.server,
                meta={"n_interruptions": gen.n_interruptions, "completion": text})
        return list(await asyncio.gather(*(one(j) for j in range(n_samples))))


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

    def __init__(self, reward_fn, feedback: str = "\nWrong, try again:\n",
                 discount: float = 0.9):
        self.reward_fn, self.feedback, self.discount = reward_fn, feedback, discount
        self.item: dict = {}
        self.turn = 0

    def reset(self, item: dict) -> None:
        self.item, self.turn = item, 0

    def step(self, completion: str, finish_reason: str = "stop") -> tuple:
        self.turn += 1
        r = float(self.reward_fn(self.item.get("prompt", ""), completion,
                                 self.item.get("answer"), finish_reason=finish_reason))
        if r > 0:
            return None, r * self.discount ** (self.turn - 1), True
        return self.feedback, 0.0, False


class MultiTurnWorkflow:
    """Alternating policy and environment turns in one token sequence. Environment tokens are
    context (loss mask 0, version -1). Stops when the environment says done, after
    ``max_turns`` policy turns, or when the token budget ``max_total_tokens`` is used up."""

    def __init__(self, env_factory, max_new_tokens: int, max_turns: int = 3,
                 max_total_tokens: int = 512, apply_chat_template: bool = True):
        self.env_factory = env_factory
        self.max_new_tokens = max_new_tokens
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.apply_chat_template = apply_chat_template

    async def arun_episode(self, ctx, item: dict, n_samples: int) -> list:
        ids = prompt_ids(ctx.tokenizer, item, self.apply_chat_template)

        async def one(j: int):
            env = self.env_factory()
            env.reset(item)
            seq = TokenSeq()
            seq.add_context(ids)
            reward, finish, servers, interrupts = 0.0, "length", [], 0
            for turn in range(self.max_turns):
                budget = min(self.max_new_tokens, self.max_total_tokens - len(seq.input_ids))
                if budget <= 0:
                    break
                gen = await ctx.generate(seq.input_ids, budget, sample_index=j, turn=turn)
                seq.add_generated(gen.output_ids, gen.logprobs, gen.versions)
                finish, interrupts = gen.finish_reason, interrupts + gen.n_interruptions
                servers.append(gen.server)
                text = _decode(ctx.tokenizer, gen.output_ids)
                obs, reward, done = await ctx.run_blocking(env.step, text, gen.finish_reason)
                if done or obs is None or turn == self.max_turns - 1:
                    break
                obs_ids = ctx.tokenizer(obs, add_special_tokens=False)["input_ids"]
                seq.add_context(obs_ids)
            return seq.to_trajectory(
                reward=reward, sample_id=ctx.sample_id(j), group_id=ctx.group_id,
                prompt_len=len(ids), finish_reason=finish,
                server_id=servers[-1] if servers else "",
                meta={"turns": len(servers), "n_interruptions": interrupts})
        return list(await asyncio.gather(*(one(j) for j in range(n_samples))))


def workflow_from_config(rollout_cfg, reward_fn=None, env_factory=None) -> Any:
    """Build the workflow named by ``rollout.workflow`` (``rlvr`` | ``multi_turn``)."""
    from areal_mega.rollout.rewards import load_reward_fn

    fn = reward_fn or load_reward_fn(rollout_cfg.reward_fn)
    if rollout_cfg.workflow == "rlvr":
        return RLVRWorkflow(fn, rollout_cfg.max_new_tokens)
    if rollout_cfg.workflow == "multi_turn":
        return MultiTurnWorkflow(env_factory or (lambda: RetryEnvironment(fn)),
                                 rollout_cfg.max_new_tokens,
                                 max_total_tokens=4 * rollout_cfg.max_new_tokens)
    raise ValueError(f"rollout.workflow={rollout_cfg.workflow!r}: must be rlvr or multi_turn")

"""Multi-task rollout: one workflow per data source, picked by the prompt item's ``source``.

Built by the rollout worker when ``data.sources`` is set: each source gets its own dataset
(:class:`~areal_mega.data.dataset.PromptDataset`, its own field mapping), its own reward
function (``reward_fn`` + ``reward_kwargs``, default ``rollout.reward_fn``) and so its own
workflow; prompts come from a :class:`~areal_mega.data.sources.MultiSourceCursor`. Every
trajectory carries ``meta["source"]``, from which the trainer logs ``reward/<name>``.
"""

from __future__ import annotations

import functools

from areal_mega.data.dataset import PromptDataset
from areal_mega.data.sources import MultiSourceCursor, resolve_sources
from areal_mega.data.vision_prompts import VisionPrompts
from areal_mega.rewards import load_reward_fn
from areal_mega.workflow.builtin import workflow_from_config


class SourceRoutedWorkflow:
    """Runs each prompt item with the workflow of its source and stamps the source name."""

    def __init__(self, workflows: dict):
        self.workflows = dict(workflows)

    async def arun_episode(self, ctx, item: dict, n_samples: int) -> list:
        name = item.get("source")
        if name not in self.workflows:
            raise ValueError(f"prompt item source={name!r}: not one of {sorted(self.workflows)}")
        trajs = await self.workflows[name].arun_episode(ctx, item, n_samples)
        for t in trajs:
            t.meta["source"] = name
        return trajs


def build_multitask(cfg, tokenizer, start: int = 0, env_factory=None):
    """(cursor, workflow) for ``cfg.data.sources``, the cursor resumed at global draw ``start``."""

    d = cfg.data
    specs = resolve_sources(d, cfg.rollout.reward_fn)
    datasets, workflows = [], {}
    for spec in specs:
        datasets.append(
            PromptDataset(
                spec.path,
                tokenizer,
                prompt_key=spec.prompt_key,
                answer_key=spec.answer_key,
                apply_chat_template=d.apply_chat_template,
                max_prompt_len=d.max_prompt_len,
                fmt=d.format,
                vision=VisionPrompts.from_config(d, cfg.model.path),
            )
        )
        fn = load_reward_fn(spec.reward_fn)
        if spec.reward_kwargs:
            fn = functools.partial(fn, **spec.reward_kwargs)
        workflows[spec.name] = workflow_from_config(
            cfg.rollout, reward_fn=fn, env_factory=env_factory
        )
    cursor = MultiSourceCursor(datasets, specs, cfg.seed, cfg.data.shuffle, start=start)
    return cursor, SourceRoutedWorkflow(workflows)

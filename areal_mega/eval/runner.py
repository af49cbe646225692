"""Generation and scoring of an evaluation set on SGLang-compatible rollout servers.

:func:`load_eval_items` reads prompt files (JSONL / parquet, as training reads them);
:func:`evaluate` sends ``n_samples`` requests per prompt through a
:class:`~areal_mega.rollout.client.RolloutClient`, scores each completion with the reward
function and returns one record per prompt (see :mod:`areal_mega.eval.scores`). A prompt with
images (:mod:`areal_mega.data.vision_prompts`) is sent with its image-expanded ids and the
images as ``image_data``. Used by the
command line (``python -m areal_mega.eval``) and by the rollout worker for evaluation during
training (:mod:`areal_mega.eval.worker_hook`).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from areal_mega.data.dataset import DataError, PromptDataset
from areal_mega.data.vision_prompts import VisionPrompts
from areal_mega.rollout.client import RolloutRequestError, sampling_dict
from areal_mega.rollout.controller import model_finish


def load_eval_items(
    paths: Sequence[str],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    apply_chat_template: bool = True,
    max_prompt_len: int = 1024,
    fmt: str = "auto",
    vision: Optional[VisionPrompts] = None,
) -> list:
    """Every prompt of every file as ``{"source", "prompt", "input_ids", "answer", "index"}``,
    with ``image_data`` (the images as PNG data URLs, encoded here once) for a prompt with
    images (``vision``: the model's image processor and ``data.images.*``).
    ``source`` is the record's ``source`` field when it has one, else the file's stem. Errors
    (a missing file or field) are :class:`~areal_mega.data.dataset.DataError` naming the file
    and line."""

    if not paths:
        raise DataError("no evaluation data files given")
    items = []
    for path in paths:
        ds = PromptDataset(
            path,
            tokenizer,
            prompt_key=prompt_key,
            answer_key=answer_key,
            apply_chat_template=apply_chat_template,
            max_prompt_len=max_prompt_len,
            fmt=fmt,
            vision=vision,
        )
        for i, it in enumerate(ds.items):
            source = it.meta.get("source")
            item = {
                "source": str(source) if source not in (None, "") else Path(path).stem,
                "prompt": it.prompt,
                "input_ids": list(it.input_ids),
                "answer": it.answer,
                "index": len(items),
            }
            if it.vision is not None:  # the server gets the images; the patches are not kept
                fields = ds.prompt_fields(i)
                item.update(input_ids=fields["input_ids"], image_data=fields["image_data"])
            items.append(item)
    return items


async def generate_to_end(
    client, input_ids: list, params: dict, rid: str, image_data: Optional[list] = None
) -> tuple:
    """``(output_ids, finish_type, server)`` of one request. A request interrupted by a weight
    update (``abort`` without an error status) is resubmitted with its partial output and the
    remaining budget (and the same ``image_data``), as the training controller does; an abort
    with an error status raises :class:`~areal_mega.rollout.client.RolloutRequestError`."""
    out: list = []
    seg = 0
    images = {"image_data": list(image_data)} if image_data else {}
    while True:
        p = dict(params, max_new_tokens=params["max_new_tokens"] - len(out))
        res = await client.generate(
            list(input_ids) + out, p, rid=f"{rid}-r{seg}", sticky_key=rid, **images
        )
        status = (res.finish_reason or {}).get("status_code")
        if res.finish_type == "abort" and status:
            client.release(rid)
            raise RolloutRequestError(
                f"{res.server}/generate: aborted with status {status}: "
                f"{(res.finish_reason or {}).get('message', '')}",
                status=int(status),
            )
        out += res.output_ids
        if res.finish_type != "abort" or len(out) >= params["max_new_tokens"]:
            client.release(rid)
            return out, (res.finish_type if res.finish_type != "abort" else "length"), res.server
        seg += 1


class _Bar:
    """tqdm on stderr over finished samples (no output when disabled)."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True
            )

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def evaluate(
    client,
    items: Sequence[dict],
    tokenizer,
    reward_fn: Callable,
    *,
    n_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
    max_new_tokens: int = 512,
    max_concurrent: int = 64,
    seed: Optional[int] = None,
    progress: bool = False,
    run_blocking: Optional[Callable] = None,
    rid_prefix: str = "eval",
    reward_fns: Optional[dict] = None,
) -> list:
    """Generate ``n_samples`` completions of every item and score them; returns one record
    per item, in item order: its ``source``, ``index``, ``prompt``, ``answer`` and per sample
    ``completions`` (text), ``output_ids``, ``rewards``, ``response_lens`` and
    ``finish_reasons`` (``stop`` | ``length``, ``stop`` when the model ended the sample with
    EOS even on its last allowed token).

    ``temperature`` 0 is greedy (deterministic). ``seed``: sampling seed of sample ``j`` of
    item ``i`` is ``seed + i * n_samples + j`` (SGLang's ``sampling_seed``); None sends none.
    ``reward_fns`` (source name -> function) overrides ``reward_fn`` for the items of those
    sources. ``reward_fn(prompt, completion, answer, finish_reason=...)`` runs off the loop via
    ``run_blocking(fn, *args, **kw)`` (default: the loop's executor); an exception in it is
    raised (an evaluation must not silently score 0). At most ``max_concurrent`` requests are
    in flight."""
    if n_samples < 1:
        raise ValueError(f"n_samples={n_samples}: must be >= 1")
    loop = asyncio.get_running_loop()
    if run_blocking is None:

        async def run_blocking(fn, *args, **kw):
            return await loop.run_in_executor(None, lambda: fn(*args, **kw))

    params = sampling_dict(max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    sem = asyncio.Semaphore(max_concurrent)
    bar = _Bar(len(items) * n_samples, progress, "eval")

    async def one(i: int, item: dict, j: int) -> tuple:
        p = dict(params)
        if seed is not None:
            p["sampling_seed"] = int(seed) + i * n_samples + j
        async with sem:
            ids, finish, _ = await generate_to_end(
                client,
                item["input_ids"],
                p,
                rid=f"{rid_prefix}-{i}-{j}",
                image_data=item.get("image_data"),
            )
        finish = model_finish(finish, ids, p, tokenizer)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        fn = (reward_fns or {}).get(item["source"], reward_fn)
        reward = float(
            await run_blocking(fn, item["prompt"], text, item["answer"], finish_reason=finish)
        )
        bar.update()
        return ids, text, finish, reward

    try:
        results = await asyncio.gather(
            *(one(i, it, j) for i, it in enumerate(items) for j in range(n_samples))
        )
    finally:
        bar.close()
    records = []
    for i, it in enumerate(items):
        mine = results[i * n_samples : (i + 1) * n_samples]
        records.append(
            {
                "source": it["source"],
                "index": it["index"],
                "prompt": it["prompt"],
                "answer": it["answer"],
                "completions": [m[1] for m in mine],
                "output_ids": [m[0] for m in mine],
                "rewards": [m[3] for m in mine],
                "response_lens": [len(m[0]) for m in mine],
                "finish_reasons": [m[2] for m in mine],
            }
        )
    return records

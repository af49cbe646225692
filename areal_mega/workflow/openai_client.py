"""An in-process OpenAI-compatible client backed by our interruptible generate.

``client.chat.completions.create(messages=..., tools=..., ...)`` and
``client.completions.create(prompt=..., ...)`` take the arguments of the ``openai`` SDK that
matter for RL (messages, tools, tool_choice, temperature, top_p, max_tokens /
max_completion_tokens, stop, n, seed, logprobs) and return the SDK's own response types
(``openai.types.chat.ChatCompletion``, ``openai.types.Completion``).

Token in, token out: the chat template is applied to the conversation once per call, the
completion tokens, logprobs and per-token weight versions are those the servers generated
(stitched across weight-update interruptions), and every choice is recorded as a
:class:`CompletionRecord` in ``client.records`` for the trajectory — nothing is re-tokenised
from text. Tool calls in the output (``<tool_call>{json}</tool_call>``) come back as OpenAI
``tool_calls`` (:mod:`areal_mega.workflow.tool_calls`).

Images (a vision-language policy): a chat message's content may carry OpenAI ``image_url``
parts whose ``url`` is a ``data:image/...;base64,`` URL (remote URLs are refused, nothing is
fetched). Each becomes the chat template's image item (``{"type": "image"}``, which renders the
model's placeholder), the decoded images expand the placeholders through the checkpoint's image
processor (:func:`areal_mega.models.vlm.inputs.encode_sample`), and the expanded ids are
generated with the images as ``image_data`` (contract C1). The decoded images stay on the
recorded completion (``CompletionRecord.images``) for the trajectory.

The request handling is :func:`chat_request` / :func:`completion_request` on plain dicts; the
HTTP endpoint (:mod:`areal_mega.workflow.openai_server`) serves the same functions.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from areal_mega.data.images import BadImage, load_image
from areal_mega.models.vlm.inputs import IMAGE_TOKEN, encode_sample
from areal_mega.workflow.tool_calls import messages_for_template, parse_tool_calls

MODEL_NAME = "areal-mega-policy"
MAX_N = 16
# accepted and ignored: they change nothing we generate
IGNORED = {
    "model",
    "user",
    "metadata",
    "store",
    "parallel_tool_calls",
    "service_tier",
    "stream_options",
    "extra_headers",
    "extra_query",
    "extra_body",
    "timeout",
}
SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "n",
    "seed",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "stream",
}
CHAT_KEYS = SAMPLING_KEYS | {
    "messages",
    "tools",
    "tool_choice",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
}
COMPLETION_KEYS = SAMPLING_KEYS | {"prompt", "echo"}
# an image part's place in a message while its text parts are joined (never in real text)
_IMAGE_SLOT = "\x00areal-image\x00"
MAX_IMAGES = 16
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class OpenAIRequestError(ValueError):
    """A request the OpenAI API would refuse: HTTP ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: Optional[str] = None,
        err_type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.param, self.err_type = status, param, err_type

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API answers."""
        return {
            "error": {
                "message": str(self),
                "type": self.err_type,
                "param": self.param,
                "code": None,
            }
        }


@dataclass
class CompletionRecord:
    """One choice of one call: exactly the tokens the servers saw and produced."""

    prompt_ids: list
    output_ids: list
    logprobs: list
    versions: list
    finish_reason: str
    n_interruptions: int = 0
    server: str = ""
    completion_id: str = ""
    created_at: float = field(default_factory=time.time)
    routed_experts: Any = None  # routing replay: routes by position from the prompt's start
    # the prompt's images in order (decoded RGB PIL images) and as sent (``image_data``)
    images: list = field(default_factory=list)
    image_data: list = field(default_factory=list)


def _num(body: dict, key: str, lo: float, hi: float, default, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise OpenAIRequestError(f"{key}={v!r}: must be {kind} in [{lo}, {hi}]", param=key)
    return v


def _check_keys(body: dict, allowed: set) -> None:
    unknown = sorted(set(body) - allowed - IGNORED)
    if unknown:
        raise OpenAIRequestError(f"unsupported parameter(s) {unknown}", param=unknown[0])
    if body.get("stream"):
        raise OpenAIRequestError(
            "stream=true is not supported by this endpoint; call without streaming", param="stream"
        )
    if body.get("echo"):
        raise OpenAIRequestError("echo=true is not supported", param="echo")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise OpenAIRequestError(
            "response_format: only {'type': 'text'} is supported", param="response_format"
        )


def sampling_of(body: dict, default_max_tokens: int) -> tuple:
    """OpenAI request fields -> ``(n, max_new_tokens, SGLang sampling dict, seed)``."""
    n = _num(body, "n", 1, MAX_N, 1, integer=True)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_new = _num({key: max_tokens}, key, 1, 1 << 20, default_max_tokens, integer=True)
    sp = {
        "temperature": _num(body, "temperature", 0.0, 2.0, None),
        "top_p": _num(body, "top_p", 1e-9, 1.0, None),
        "frequency_penalty": _num(body, "frequency_penalty", -2.0, 2.0, None),
        "presence_penalty": _num(body, "presence_penalty", -2.0, 2.0, None),
    }
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not (
            isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)
        ):
            raise OpenAIRequestError("stop: expected a string or up to 4 strings", param="stop")
        sp["stop"] = stop
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            sp["logit_bias"] = {
                int(k): float(_num({"logit_bias": v}, "logit_bias", -100, 100, 0))
                for k, v in bias.items()
            }
        except (AttributeError, TypeError, ValueError):
            raise OpenAIRequestError(
                "logit_bias: expected {token id: number in [-100, 100]}", param="logit_bias"
            ) from None
    seed = _num(body, "seed", -(1 << 63), (1 << 63) - 1, None, integer=True)
    return n, max_new, {k: v for k, v in sp.items() if v is not None}, seed


def _take_images(messages: list) -> tuple:
    """OpenAI messages -> (the messages with each ``image_url`` part a text slot, the image
    URLs in order). Only ``data:image/`` URLs are accepted (nothing is fetched)."""
    out, urls = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if not (isinstance(p, dict) and p.get("type") == "image_url"):
                parts.append(p)
                continue
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:image/"):
                raise OpenAIRequestError(
                    f"messages[{i}].content[{j}].image_url.url: only data:image/...;base64 URLs "
                    "are accepted (remote images are not fetched; send the image inline)",
                    param="messages",
                )
            urls.append(url)
            parts.append({"type": "text", "text": _IMAGE_SLOT})
        out.append(dict(m, content=parts))
    if len(urls) > MAX_IMAGES:
        raise OpenAIRequestError(
            f"messages: {len(urls)} images, at most {MAX_IMAGES}", param="messages"
        )
    return out, urls


def _with_image_items(msgs: list) -> list:
    """Template messages whose joined text holds image slots -> content lists with the
    template's image items (``{"type": "image"}``) in their places."""
    for m in msgs:
        c = m.get("content")
        if isinstance(c, str) and _IMAGE_SLOT in c:
            parts = []
            for k, piece in enumerate(c.split(_IMAGE_SLOT)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m["content"] = parts
    return msgs


def _image_prompt(msgs: list, urls: list, tokenizer, image_processor, tools) -> tuple:
    """The expanded prompt ids and decoded images of a chat with images (see the module
    docstring); :class:`OpenAIRequestError` for an image that does not decode or a text that
    holds image placeholders of its own."""
    images = []
    for k, url in enumerate(urls):
        try:
            images.append(
                load_image(
                    url, base_dir=Path("/"), what=f"image {k}", max_source_pixels=MAX_IMAGE_PIXELS
                )
            )
        except BadImage as e:
            raise OpenAIRequestError(f"messages: {e}", param="messages") from None
    text = tokenizer.apply_chat_template(
        _with_image_items(msgs), tools=tools, tokenize=False, add_generation_prompt=True
    )
    if text.count(IMAGE_TOKEN) != len(images):
        raise OpenAIRequestError(
            f"messages: the rendered chat has {text.count(IMAGE_TOKEN)} {IMAGE_TOKEN} "
            f"placeholders for {len(images)} images (is {IMAGE_TOKEN} in the text, or does the "
            "chat template drop image items?)",
            param="messages",
        )
    sample = encode_sample(text, images, tokenizer, image_processor)
    return sample.input_ids.tolist(), images


def _cut_at_stop(text: str, stop) -> str:
    cuts = [text.find(s) for s in (stop or []) if s and s in text]
    return text[: min(cuts)] if cuts else text


async def _generate_choices(
    generate: Callable, prompt_ids: list, n: int, max_new: int, sp: dict, seed, images=None
) -> list:
    """``images``: ``(decoded images, image_data)`` of the prompt, or None."""

    async def one(i: int):
        extra = dict(sp)
        if seed is not None:
            extra["sampling_seed"] = int(seed) + i
        if images:
            extra["image_data"] = list(images[1])
        gen = await generate(prompt_ids, max_new, **extra)
        if gen.finish_reason == "abort":
            raise OpenAIRequestError(
                "generation was stopped (the rollout is shutting down)",
                status=503,
                err_type="server_error",
            )
        return CompletionRecord(
            list(prompt_ids),
            list(gen.output_ids),
            list(gen.logprobs),
            list(gen.versions),
            gen.finish_reason,
            gen.n_interruptions,
            gen.server,
            routed_experts=gen.routed_experts,
            images=list(images[0]) if images else [],
            image_data=list(images[1]) if images else [],
        )

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _logprobs_content(tokenizer, rec: CompletionRecord) -> list:
    out = []
    for t, lp in zip(rec.output_ids, rec.logprobs):
        s = tokenizer.decode([t]) if tokenizer is not None else str(t)
        out.append(
            {"token": s, "logprob": float(lp), "bytes": list(s.encode()), "top_logprobs": []}
        )
    return out


def _usage(records: list) -> dict:
    p = len(records[0].prompt_ids) if records else 0
    c = sum(len(r.output_ids) for r in records)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


async def chat_request(
    body: dict,
    generate: Callable,
    tokenizer,
    records: list,
    default_max_tokens: int,
    image_processor=None,
) -> dict:
    """Answer one ``/v1/chat/completions`` body (a dict) with a ``chat.completion`` dict;
    appends one :class:`CompletionRecord` per choice to ``records``. Raises
    :class:`OpenAIRequestError` for a request the OpenAI API would refuse. ``image_processor``:
    a vision-language policy's (None: ``image_url`` parts are refused)."""
    _check_keys(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise OpenAIRequestError("messages: required, a list of message objects", param="messages")
    messages, urls = _take_images(messages)
    if urls and image_processor is None:
        raise OpenAIRequestError(
            "messages: image_url parts need a vision-language policy (this model has no image "
            "processor)",
            param="messages",
        )
    try:
        msgs = messages_for_template(messages)
    except ValueError as e:
        raise OpenAIRequestError(str(e), param="messages") from None
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise OpenAIRequestError("tools: expected a list of tool objects", param="tools")
    if body.get("tool_choice") not in (None, "auto", "none") and not tools:
        raise OpenAIRequestError("tool_choice needs tools", param="tool_choice")
    n, max_new, sp, seed = sampling_of(body, default_max_tokens)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise OpenAIRequestError("this model has no chat template; use /v1/completions")
    # tool_choice "none": the model is not offered the tools
    offer = tools if body.get("tool_choice") != "none" else None
    images = None
    if urls:
        prompt_ids, decoded = await asyncio.to_thread(
            _image_prompt, msgs, urls, tokenizer, image_processor, offer
        )
        images = (decoded, urls)
    else:
        prompt_ids = list(
            tokenizer.apply_chat_template(
                msgs, tools=offer, tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
    recs = await _generate_choices(generate, prompt_ids, n, max_new, sp, seed, images)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    choices = []
    for i, rec in enumerate(recs):
        rec.completion_id = f"{cid}-{i}"
        text = _cut_at_stop(_decode(tokenizer, rec.output_ids), sp.get("stop"))
        content, calls = parse_tool_calls(text) if offer else (text, [])
        finish = "tool_calls" if calls else rec.finish_reason
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        choices.append(
            {
                "index": i,
                "message": msg,
                "finish_reason": finish,
                "logprobs": (
                    {"content": _logprobs_content(tokenizer, rec)} if body.get("logprobs") else None
                ),
            }
        )
    records.extend(recs)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or MODEL_NAME,
        "choices": choices,
        "usage": _usage(recs),
    }


async def completion_request(
    body: dict,
    generate: Callable,
    tokenizer,
    records: list,
    default_max_tokens: int,
    image_processor=None,
) -> dict:
    """Answer one ``/v1/completions`` body with a ``text_completion`` dict (prompt: a string
    or a list of token ids); records like :func:`chat_request` (no images here:
    ``image_processor`` is accepted for a uniform handler signature and unused)."""
    _check_keys(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise OpenAIRequestError("this model has no tokenizer; send token ids", param="prompt")
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompt_ids = list(prompt)
    else:
        raise OpenAIRequestError("prompt: expected a string or a list of token ids", param="prompt")
    if not prompt_ids:
        raise OpenAIRequestError("prompt: must not be empty", param="prompt")
    n, max_new, sp, seed = sampling_of(body, default_max_tokens)
    recs = await _generate_choices(generate, prompt_ids, n, max_new, sp, seed)
    cid = f"cmpl-{uuid.uuid4().hex}"
    choices = []
    for i, rec in enumerate(recs):
        rec.completion_id = f"{cid}-{i}"
        lp = None
        if body.get("logprobs"):
            toks = [
                tokenizer.decode([t]) if tokenizer is not None else str(t) for t in rec.output_ids
            ]
            lp = {
                "tokens": toks,
                "token_logprobs": [float(x) for x in rec.logprobs],
                "text_offset": [],
                "top_logprobs": [],
            }
        choices.append(
            {
                "index": i,
                "finish_reason": rec.finish_reason,
                "logprobs": lp,
                "text": _cut_at_stop(_decode(tokenizer, rec.output_ids), sp.get("stop")),
            }
        )
    records.extend(recs)
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or MODEL_NAME,
        "choices": choices,
        "usage": _usage(recs),
    }


class _Endpoint:
    def __init__(self, client: "OpenAICompatClient", handler: Callable, sdk_type: str):
        self._client, self._handler, self._sdk_type = client, handler, sdk_type

    async def create(self, **kwargs):
        """Same arguments as the ``openai`` SDK's ``create``; returns the SDK's type."""
        c = self._client
        body = await self._handler(
            kwargs,
            c.generate,
            c.tokenizer,
            c.records,
            c.default_max_tokens,
            image_processor=c.image_processor,
        )
        if self._sdk_type == "chat":
            from openai.types.chat import ChatCompletion

            return ChatCompletion.model_validate(body)
        from openai.types import Completion

        return Completion.model_validate(body)


class _Chat:
    def __init__(self, client):
        self.completions = _Endpoint(client, chat_request, "chat")


class OpenAICompatClient:
    """``client.chat.completions.create`` / ``client.completions.create`` in process.
    ``generate(input_ids, max_new_tokens, **sampling)`` is an interruptible generate (e.g.
    :meth:`~areal_mega.workflow.api.SampleContext.generate`); ``records`` holds one
    :class:`CompletionRecord` per returned choice, in call order. ``image_processor``: a
    vision-language policy's image processor (chat messages may then carry ``image_url``
    parts, see the module docstring)."""

    def __init__(
        self, generate: Callable, tokenizer, default_max_tokens: int = 512, image_processor=None
    ):
        self.generate = generate
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.default_max_tokens = int(default_max_tokens)
        self.records: list = []
        self.chat = _Chat(self)
        self.completions = _Endpoint(self, completion_request, "completion")

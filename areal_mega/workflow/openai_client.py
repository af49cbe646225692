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

The request handling is :func:`chat_request` / :func:`completion_request` on plain dicts; the
HTTP endpoint (:mod:`areal_mega.workflow.openai_server`) serves the same functions.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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


def _cut_at_stop(text: str, stop) -> str:
    cuts = [text.find(s) for s in (stop or []) if s and s in text]
    return text[: min(cuts)] if cuts else text


async def _generate_choices(
    generate: Callable, prompt_ids: list, n: int, max_new: int, sp: dict, seed
) -> list:
    async def one(i: int):
        extra = dict(sp)
        if seed is not None:
            extra["sampling_seed"] = int(seed) + i
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
    body: dict, generate: Callable, tokenizer, records: list, default_max_tokens: int
) -> dict:
    """Answer one ``/v1/chat/completions`` body (a dict) with a ``chat.completion`` dict;
    appends one :class:`CompletionRecord` per choice to ``records``. Raises
    :class:`OpenAIRequestError` for a request the OpenAI API would refuse."""
    _check_keys(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise OpenAIRequestError("messages: required, a list of message objects", param="messages")
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
    prompt_ids = list(
        tokenizer.apply_chat_template(
            msgs, tools=offer, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    recs = await _generate_choices(generate, prompt_ids, n, max_new, sp, seed)
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
    body: dict, generate: Callable, tokenizer, records: list, default_max_tokens: int
) -> dict:
    """Answer one ``/v1/completions`` body with a ``text_completion`` dict (prompt: a string
    or a list of token ids); records like :func:`chat_request`."""
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
        body = await self._handler(kwargs, c.generate, c.tokenizer, c.records, c.default_max_tokens)
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
    :class:`CompletionRecord` per returned choice, in call order."""

    def __init__(self, generate: Callable, tokenizer, default_max_tokens: int = 512):
        self.generate = generate
        self.tokenizer = tokenizer
        self.default_max_tokens = int(default_max_tokens)
        self.records: list = []
        self.chat = _Chat(self)
        self.completions = _Endpoint(self, completion_request, "completion")

"""Request parsing and response shaping of the CPU rollout server, following SGLang's HTTP API.

What SGLang does, and so what this module does:
- ``/generate`` ignores top-level keys it does not know (SGLang parses the body into a
  dataclass that drops extras), so unmodified clients such as AReaL (which sends
  ``"image_data": null``) are served. Known keys asking for something this server cannot do
  (videos, audio, LoRA, streaming, hidden states, grammars, ...) are refused with 400 naming
  the key rather than silently ignored; ``image_data`` is served on a vision-language
  checkpoint (:mod:`areal_mega.inference.vision`) and refused on a text-only one;
- ``sampling_params`` keys SGLang does not know are refused (SGLang passes them to
  ``SamplingParams(**...)``, which raises); a key set to ``null`` means its default; ranges are
  SGLang's ``SamplingParams.verify``;
- ``n > 1`` (or a batch of prompts) answers a list, prompt-major, rids ``"{rid}_{i}"``;
- the answer's ``text`` is decoded with ``skip_special_tokens`` /
  ``spaces_between_special_tokens``; unless ``no_stop_trim`` the matched stop token is left out
  of the text and the text is cut before a matched stop string (``output_ids`` and logprobs
  keep every generated token, as on SGLang);
- with ``return_logprob`` the answer carries ``input_token_logprobs`` from ``logprob_start_len``
  on (default: the last prompt token only, value None), at temperature 1; ``max_new_tokens: 0``
  scores a sequence without generating (see :mod:`areal_mega.inference.input_logprobs`);
- ``return_routed_experts`` on a server started with ``--enable-return-routed-experts`` adds
  ``meta_info["routed_experts"]`` (format: :mod:`areal_mega.common.moe_routes`); without the
  flag the request is served and the key left out, as SGLang does; ``routed_experts_start_len``
  (in ``[0, prompt length]``) starts them at that token.

Beyond SGLang's own checks (so that one bad request is answered 400 instead of failing the
batch or the handler with 500): every float field must be finite (Python's ``json`` accepts
``NaN`` and ``Infinity``), every int field must fit in int64 (``sampling_seed``:
``[0, 2**63)``), and one ``/generate`` call may ask for at most :data:`MAX_OUTPUTS` outputs.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any, Optional

import numpy as np
import torch

from areal_mega.common.moe_routes import encode_sglang_routes
from areal_mega.inference.input_logprobs import needs_forward, resolve_start
from areal_mega.inference.sampling import SamplingParams

log = logging.getLogger("areal_mega.inference.server")

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# load formats meaning "plain tensors / safetensors files"; others change the wire format or
# the loader and are refused
DISK_LOAD_FORMATS = (None, "auto", "safetensors")
DIST_LOAD_FORMATS = (None, "auto", "direct")

SAMPLING_FIELDS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
# sampling keys SGLang honours that change the output in a way this server does not implement
UNSUPPORTED_SAMPLING = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag")
# top-level /generate keys that must keep their "off" value here
UNSUPPORTED_GENERATE = (
    "input_embeds",
    "video_data",
    "audio_data",
    "custom_logit_processor",
    "session_params",
    "token_ids_logprob",
    "return_hidden_states",
    "return_entropy",
    "stream",
)


INT64_MAX = 2**63 - 1
# outputs (prompts x n) one /generate call may ask for; more is refused rather than queued
MAX_OUTPUTS = 4096
MAX_BODY = 64 << 20
"""Largest request body (bytes); a larger one is answered 413."""


class BadRequest(ValueError):
    """Raised on invalid input; answered with HTTP ``status`` (400) and the message."""

    status = 400


class Conflict(BadRequest):
    """The request is valid but clashes with the server's state (e.g. a group still joining);
    answered with HTTP 409."""

    status = 409


class TooLarge(BadRequest):
    """The request body exceeds the server's limit; answered with HTTP 413."""

    status = 413


class RequestTimeout(BadRequest):
    """The client did not send its request body in time; answered with HTTP 408 (and the
    connection is closed)."""

    status = 408


def error_response(status: int, message: str):
    """SGLang-style JSON error answer ``{"error": {"message", "code"}}``."""
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def ignore_unknown(body: dict, allowed: set, where: str) -> None:
    """SGLang drops keys a control endpoint does not know; so do we (logged at debug)."""
    extra = sorted(set(body) - allowed)
    if extra:
        log.debug("%s: ignoring unknown field(s) %s", where, extra)


def version_of(body: dict, where: str) -> Optional[str]:
    """``body["weight_version"]`` as a string (None if absent; 400 for a container)."""
    v = body.get("weight_version")
    if isinstance(v, (dict, list, bool)):
        raise BadRequest(f"{where}.weight_version={v!r}: expected a string")
    return None if v is None else str(v)


def load_format_of(body: dict, where: str, allowed: tuple) -> None:
    """400 unless ``body["load_format"]`` is one of ``allowed``."""
    fmt = body.get("load_format")
    if fmt not in allowed:
        raise BadRequest(
            f"{where}.load_format={fmt!r}: not supported by this server "
            f"(supported: {[f for f in allowed if f]})"
        )


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16`` (400 otherwise)."""
    key = str(name).replace("torch.", "")
    if key not in DTYPES:
        raise BadRequest(f"dtype {name!r}: must be one of {sorted(DTYPES)}")
    return DTYPES[key]


def get_field(
    body: dict, key: str, tp, default=None, where: str = "request", required: bool = False
):
    """``body[key]`` checked to be of type ``tp`` (ints accepted for floats); missing or null
    gives ``default`` (or a :class:`BadRequest` when ``required``)."""
    if key not in body or body[key] is None:
        if required:
            raise BadRequest(f"{where}.{key}: required")
        return default
    v = body[key]
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        try:
            v = float(v)
        except OverflowError:  # 10**400: beyond any float
            raise BadRequest(f"{where}.{key}: out of range (must be a finite number)") from None
    if tp is int and isinstance(v, bool) or not isinstance(v, tp):
        raise BadRequest(f"{where}.{key}={v!r}: expected {getattr(tp, '__name__', tp)}")
    if tp is float and not math.isfinite(v):
        raise BadRequest(f"{where}.{key}={v!r}: must be a finite number")
    if tp is int and not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise BadRequest(f"{where}.{key}={v}: out of range (must fit in int64)")
    return v


def get_int_like(body: dict, key: str, where: str, required: bool = True, default=None):
    """An int that may come as a decimal string (SGLang's pydantic parsing accepts
    ``"master_port": "29500"``, which AReaL sends)."""
    v = body.get(key)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v.strip())
    return get_field(body, key, int, default, where, required)


def _off(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def parse_sampling(
    sp: dict, n_prompt: int, tokenizer, vocab_size: int, max_context: int, top_logprobs_num: int = 0
) -> tuple[SamplingParams, int]:
    """``sampling_params`` -> (:class:`SamplingParams`, n). Raises :class:`BadRequest` naming
    the offending key."""
    w = "sampling_params"
    unknown = sorted(set(sp) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"{w}: unknown field(s) {unknown}; allowed: {sorted(SAMPLING_FIELDS)}")
    for key in UNSUPPORTED_SAMPLING:
        if not _off(sp.get(key)):
            raise BadRequest(f"{w}.{key}: not supported by this server")
    stop = sp.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest(f"{w}.stop={stop!r}: expected a string or a list of strings")
    stop = [s for s in (stop or []) if s]
    if stop and tokenizer is None:
        raise BadRequest(f"{w}.stop: this model has no tokenizer to match stop strings")
    stop_ids = get_field(sp, "stop_token_ids", list, [], w)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest(f"{w}.stop_token_ids: expected a list of ints")
    bias = get_field(sp, "logit_bias", dict, {}, w)
    try:
        bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{w}.logit_bias: expected {{token id: number}}") from None
    if not all(math.isfinite(v) for v in bias.values()):
        raise BadRequest(f"{w}.logit_bias: values must be finite numbers")
    if any(not 0 <= k < vocab_size for k in bias):
        raise BadRequest(f"{w}.logit_bias: keys must be token ids in [0, {vocab_size})")
    max_new = get_field(sp, "max_new_tokens", int, 128, w)
    if "max_new_tokens" in sp and sp["max_new_tokens"] is None:
        max_new = max(max_context - n_prompt - 1, 0)
    p = SamplingParams(
        max_new_tokens=max_new,
        temperature=get_field(sp, "temperature", float, 1.0, w),
        top_p=get_field(sp, "top_p", float, 1.0, w),
        top_k=get_field(sp, "top_k", int, -1, w),
        min_p=get_field(sp, "min_p", float, 0.0, w),
        frequency_penalty=get_field(sp, "frequency_penalty", float, 0.0, w),
        presence_penalty=get_field(sp, "presence_penalty", float, 0.0, w),
        repetition_penalty=get_field(sp, "repetition_penalty", float, 1.0, w),
        min_new_tokens=get_field(sp, "min_new_tokens", int, 0, w),
        stop_token_ids=tuple(stop_ids),
        stop_strs=tuple(stop),
        stop_str_max_len=max(
            (len(tokenizer.encode(s, add_special_tokens=False)) for s in stop), default=0
        ),
        ignore_eos=get_field(sp, "ignore_eos", bool, False, w),
        sampling_seed=get_field(sp, "sampling_seed", int, None, w),
        logit_bias=bias,
        skip_special_tokens=get_field(sp, "skip_special_tokens", bool, True, w),
        spaces_between_special_tokens=get_field(sp, "spaces_between_special_tokens", bool, True, w),
        no_stop_trim=get_field(sp, "no_stop_trim", bool, False, w),
        top_logprobs_num=top_logprobs_num,
    )
    n = get_field(sp, "n", int, 1, w)
    _verify(p, n, w)
    if n_prompt + p.max_new_tokens >= max_context:
        raise BadRequest(
            f"request too long: {n_prompt} prompt tokens + max_new_tokens "
            f"{p.max_new_tokens} >= context length {max_context}"
        )
    return p, n


def _verify(p: SamplingParams, n: int, w: str) -> None:
    """SGLang's ``SamplingParams.verify`` ranges."""
    checks = [
        (math.isfinite(p.temperature) and p.temperature >= 0, "temperature", "must be >= 0"),
        (0 < p.top_p <= 1, "top_p", "must be in (0, 1]"),
        (0 <= p.min_p <= 1, "min_p", "must be in [0, 1]"),
        (p.top_k == -1 or p.top_k >= 1, "top_k", "must be -1 (off) or >= 1"),
        (-2 <= p.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
        (-2 <= p.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
        (0 < p.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]"),
        (p.max_new_tokens >= 0, "max_new_tokens", "must be >= 0"),
        (
            0 <= p.min_new_tokens <= p.max_new_tokens,
            "min_new_tokens",
            "must be in [0, max_new_tokens]",
        ),
        (n >= 1, "n", "must be >= 1"),
        (p.sampling_seed is None or p.sampling_seed >= 0, "sampling_seed", "must be >= 0"),
    ]
    for ok, key, msg in checks:
        if not ok:
            raise BadRequest(f"{w}.{key}: {msg}")


def parse_generate(body: dict, tokenizer, vocab_size: int, max_context: int):
    """A ``/generate`` body -> ``(prompts, params, n, rids, batched)``: one token-id list per
    prompt, the shared :class:`SamplingParams`, samples per prompt, one rid per output, and
    whether the answer is a list."""
    for key in UNSUPPORTED_GENERATE:
        if not _off(body.get(key)):
            raise BadRequest(f"generate.{key}: not supported by this server")
    ids = body.get("input_ids")
    if ids is None:
        text = body.get("text")
        if text is None:
            raise BadRequest("generate: one of input_ids or text is required")
        if not (
            isinstance(text, str)
            or isinstance(text, list)
            and all(isinstance(t, str) for t in text)
            and text
        ):
            raise BadRequest("generate.text: expected a string or a non-empty list of strings")
        if tokenizer is None:
            raise BadRequest("generate.text: this model has no tokenizer; send input_ids")
        ids = [
            tokenizer(t, add_special_tokens=False)["input_ids"]
            for t in ([text] if isinstance(text, str) else text)
        ]
        batched = isinstance(text, list)
    else:
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        ids = ids if batched else [ids]
    for one in ids:
        if (
            not isinstance(one, list)
            or not one
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in one)
        ):
            raise BadRequest(
                "generate.input_ids: expected a non-empty list of ints (or a list of such lists)"
            )
        if min(one) < 0 or max(one) >= vocab_size:
            raise BadRequest(f"generate.input_ids: token ids must be in [0, {vocab_size})")
    top_n = get_field(body, "top_logprobs_num", int, 0, "generate")
    if top_n < 0:
        raise BadRequest("generate.top_logprobs_num: must be >= 0")
    sp = get_field(body, "sampling_params", dict, {}, "generate")
    params, n = parse_sampling(
        sp,
        max(len(x) for x in ids),
        tokenizer,
        vocab_size,
        max_context,
        top_n if body.get("return_logprob") else 0,
    )
    count = len(ids) * n
    if count > MAX_OUTPUTS:
        raise BadRequest(
            f"generate: {len(ids)} prompt(s) x n={n} = {count} outputs; at most "
            f"{MAX_OUTPUTS} per request"
        )
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(count)]
    elif isinstance(rid, str):
        rids = [rid] if count == 1 else [f"{rid}_{i}" for i in range(count)]
    elif isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        raise BadRequest(f"generate.rid: expected a string or a list of {count} strings")
    return ids, params, n, rids, batched or n > 1


def parse_logprob_starts(body: dict, prompts: list) -> Optional[list]:
    """``logprob_start_len`` (an int, or one per prompt) resolved per prompt as SGLang reads it
    (see :mod:`areal_mega.inference.input_logprobs`); None without ``return_logprob`` (SGLang
    then ignores the field). 400 naming the field for a value other than -1 outside
    ``[0, len(prompt))``, and for input positions asked together with ``top_logprobs_num``
    (input top logprobs are not implemented here)."""
    w = "generate.logprob_start_len"
    raw = body.get("logprob_start_len")
    if raw is None:
        raw = -1
    if isinstance(raw, list):
        if len(raw) != len(prompts):
            raise BadRequest(f"{w}: a list must have one entry per prompt ({len(prompts)})")
        vals = raw
    else:
        vals = [raw] * len(prompts)
    for v in vals:
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadRequest(f"{w}={raw!r}: expected an int or a list of ints")
    if not body.get("return_logprob"):
        return None
    top_n = get_field(body, "top_logprobs_num", int, 0, "generate")
    starts = []
    for ids, v in zip(prompts, vals):
        k = resolve_start(v, len(ids))
        if not 0 <= k < len(ids):
            raise BadRequest(
                f"{w}={v}: must be -1 or in [0, {len(ids)}) for a prompt of {len(ids)} tokens"
            )
        if top_n and needs_forward(k, len(ids)):
            raise BadRequest(
                f"{w}={v} with top_logprobs_num={top_n}: input top logprobs are "
                "not supported by this server"
            )
        starts.append(k)
    return starts


def parse_routes_start(body: dict, prompts: list) -> int:
    """SGLang's ``routed_experts_start_len``: the answer's routes cover tokens
    ``[start, seqlen - 1)``; must be in ``[0, prompt length]`` (400 naming the key)."""
    start = get_field(body, "routed_experts_start_len", int, 0, "generate")
    shortest = min(len(p) for p in prompts)
    if not 0 <= start <= shortest:
        raise BadRequest(
            f"generate.routed_experts_start_len={start}: must be in "
            f"[0, {shortest}] (the prompt's length)"
        )
    return start


def output_text(decode, r, params: SamplingParams) -> str:
    """The ``text`` SGLang returns for finished request ``r`` (see the module docstring)."""
    if decode is None:
        return ""
    ids = list(r.output_ids)
    matched = (r.finish_reason or {}).get("matched")
    if not params.no_stop_trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = decode(
        ids,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )
    if not params.no_stop_trim and isinstance(matched, str):
        pos = text.find(matched)
        text = text[:pos] if pos != -1 else text
    return text


def response_of(
    r,
    prompt_len: int,
    params: SamplingParams,
    return_logprob: bool,
    text_in_logprobs: bool,
    decode,
    now: float,
    input_lp: Optional[tuple] = None,
) -> dict:
    """One ``/generate`` answer object for finished request ``r``; ``input_lp`` is ``(values,
    token_ids)`` of its prompt's input positions from ``logprob_start_len`` on."""
    meta: dict = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": prompt_len,
        "completion_tokens": len(r.output_ids),
        "cached_tokens": r.cached_tokens,
        "weight_version": r.weight_version,
        "e2e_latency": now - r.created_at,
    }
    if return_logprob:

        def tok_text(t: int) -> Optional[str]:
            return decode([t], skip_special_tokens=False) if text_in_logprobs and decode else None

        meta["output_token_logprobs"] = [
            [lp, t, tok_text(t)] for lp, t in zip(r.logprobs, r.output_ids)
        ]
        if input_lp is not None:
            meta["input_token_logprobs"] = [[lp, t, tok_text(t)] for lp, t in zip(*input_lp)]
        if params.top_logprobs_num:
            meta["input_top_logprobs"] = [None]
            meta["output_top_logprobs"] = [
                [[lp, t, tok_text(t)] for lp, t in step] for step in r.top_logprobs
            ]
    if r.return_routed_experts and r.routes:  # SGLang: tokens [start, seqlen - 1)
        seqlen = prompt_len + len(r.output_ids)
        meta["routed_experts"] = encode_sglang_routes(
            np.concatenate(r.routes)[r.routes_start : seqlen - 1]
        )
    return {
        "text": output_text(decode, r, params),
        "output_ids": list(r.output_ids),
        "meta_info": meta,
    }

"""The ``/generate`` exchange of :class:`~areal_mega.rollout.client.RolloutClient`: the request
body, the parsed answer and the client's errors (SGLang's native API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


class RolloutRequestError(RuntimeError):
    """The server rejected a request (HTTP 4xx); retrying elsewhere would not help.
    ``status`` is the HTTP status code."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class RolloutServerError(RuntimeError):
    """No server could complete a request after all retries."""


@dataclass
class GenerateResult:
    """One ``/generate`` answer, parsed. ``routed_experts``: SGLang's encoded
    ``meta_info.routed_experts`` when the server returned it (decode with
    :func:`areal_mega.common.moe_routes.decode_sglang_routes`), else None."""

    output_ids: list
    logprobs: list
    finish_reason: dict
    weight_version: Optional[str]
    server: str
    raw: dict = field(repr=False, default_factory=dict)
    routed_experts: Optional[str] = field(repr=False, default=None)
    # the version of each output token when the server reports them per token (vLLM's
    # weight-version spans); None: ``weight_version`` holds for all of them
    token_versions: Optional[list] = field(repr=False, default=None)

    @property
    def finish_type(self) -> str:
        return (self.finish_reason or {}).get("type", "abort")


def generate_body(
    input_ids: list,
    sampling_params: dict,
    rid: Optional[str] = None,
    return_routed_experts: bool = False,
    routes_from: int = 0,
    lora_path: Optional[str] = None,
    image_data: Optional[list] = None,
) -> dict:
    """The JSON body of one ``/generate`` call (token ids in, logprobs out, no streaming);
    routes only from position ``routes_from`` (SGLang's ``routed_experts_start_len``: a
    resumed call needs none of the positions routed before); ``lora_path``: the LoRA adapter
    name (SGLang's field; None: the base model). ``image_data``: SGLang's native field, one
    string per image of the prompt in order (a ``data:image/...;base64,`` URL, raw base64 or a
    path the server can read); ``input_ids`` are then the processor-expanded prompt (one
    ``<|image_pad|>`` per merged patch). None or empty: a text prompt."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": sampling_params,
        "return_logprob": True,
        "stream": False,
    }
    if rid is not None:
        body["rid"] = rid
    if lora_path is not None:
        body["lora_path"] = lora_path
    if image_data:
        body["image_data"] = list(image_data)
    if return_routed_experts:
        body["return_routed_experts"] = True
        if routes_from:
            body["routed_experts_start_len"] = int(routes_from)
    return body


def parse_generate_answer(out: dict, server: str) -> GenerateResult:
    """A ``/generate`` answer object from ``server`` -> :class:`GenerateResult`."""
    meta = out.get("meta_info", {})
    lps = meta.get("output_token_logprobs") or []
    return GenerateResult(
        output_ids=list(out.get("output_ids", [])),
        logprobs=[float(x[0]) for x in lps],
        finish_reason=meta.get("finish_reason") or {"type": "abort"},
        weight_version=meta.get("weight_version"),
        server=server,
        raw=out,
        routed_experts=meta.get("routed_experts"),
        token_versions=meta.get("token_weight_versions"),
    )


def token_versions(res: GenerateResult, default: int) -> list:
    """The integer weight version of each of ``res``'s output tokens: the server's per-token
    versions, else its one ``weight_version``, else ``default`` (what the caller knows); a
    version that is not an integer counts as ``default``."""

    def as_int(v) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            return default

    if res.token_versions is not None:
        return [as_int(v) for v in res.token_versions]
    return [as_int(res.weight_version)] * len(res.output_ids)


def sampling_dict(
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    stop_token_ids: Optional[list] = None,
    ignore_eos: bool = False,
    **extra: Any,
) -> dict:
    """SGLang ``sampling_params`` dict."""
    d = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "ignore_eos": bool(ignore_eos),
    }
    if stop_token_ids:
        d["stop_token_ids"] = list(stop_token_ids)
    d.update(extra)
    return d

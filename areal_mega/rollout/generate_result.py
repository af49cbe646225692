"""The ``/generate`` exchange of :class:`~areal_mega.rollout.client.RolloutClient`: the request
body, the parsed answer and the client's errors (SGLang's native API).

Images (contract C1): a prompt's images travel as SGLang's native ``image_data`` (one string per
image, in order: a ``data:image/...;base64,`` URL, raw base64 or a path the server reads) next
to ``input_ids`` that are the processor-expanded prompt (each image a run of ``<|image_pad|>``,
one per merged patch, between ``<|vision_start|>`` and ``<|vision_end|>``). What SGLang does
with such a request: when ``input_ids`` come with ``image_data``, its tokenizer manager hands the
ids to the model's multimodal processor, which decodes them back to text, finds each image by a
pattern matching ``<|vision_start|>`` + one or more ``<|image_pad|>`` + ``<|vision_end|>`` (so
expanded and unexpanded placeholders are both accepted), resizes each image into its own pixel
bounds (Qwen-VL: at least 4·28·28 pixels, at most ``SGLANG_IMAGE_MAX_PIXELS``), runs the HF
processor and re-tokenizes: the prompt it generates from is its own expansion. It equals ours
when the images already lie within both its bounds and the checkpoint processor's, and the
decoded text re-tokenizes to the same ids; :func:`check_prompt_tokens` compares the answer's
``meta_info.prompt_tokens`` with the ids sent and refuses a difference (the trainer would score
another sequence than the one sampled). SGLang has no switch to ban tokens per server; its
``sampling_params.logit_bias`` (``{token id string: bias}``, added to the logits before
sampling and before the reported logprob) with :data:`FORBIDDEN_BIAS` is how the vision special
tokens are never sampled (:func:`forbid_tokens`; the CPU server also masks them itself).
"""

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


#: the ``logit_bias`` that keeps a token from being sampled: far below any logit, and finite
#: (JSON has no infinity); its probability is exactly 0 in float32
FORBIDDEN_BIAS = -1.0e4


def forbid_tokens(sampling_params: dict, token_ids) -> dict:
    """``sampling_params`` with ``token_ids`` given :data:`FORBIDDEN_BIAS` in its
    ``logit_bias`` (merged with the caller's own; a copy)."""
    if not token_ids:
        return sampling_params
    bias = dict(sampling_params.get("logit_bias") or {})
    bias.update({str(int(t)): FORBIDDEN_BIAS for t in token_ids})
    return dict(sampling_params, logit_bias=bias)


def check_prompt_tokens(res: "GenerateResult", sent: int) -> None:
    """Raise :class:`RolloutRequestError` when a prompt with images came back with another
    prompt length (``meta_info.prompt_tokens``) than the ``sent`` expanded ids: the server
    expanded the images otherwise (see the module docstring)."""
    got = (res.raw.get("meta_info") or {}).get("prompt_tokens")
    if got is not None and int(got) != sent:
        raise RolloutRequestError(
            f"{res.server}/generate: the server expanded the prompt with its images to {got} "
            f"tokens, the request had {sent}: its image processor sizes the images otherwise "
            "(keep images within both the server's and the checkpoint processor's pixel bounds)",
            status=400,
        )


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

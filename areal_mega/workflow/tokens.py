"""Token sequences of one sample and prompt tokenisation, shared by the Workflow API
(:mod:`areal_mega.workflow.api`) and the built-in workflows.

Per-token fields follow the data-plane contract: ``loss_mask`` 1 only on generated tokens;
``logprobs`` 0 and ``versions`` -1 on prompt and environment tokens. With routing replay the
sequence also keeps the MoE routes its generations returned (``token_extras.routed_experts``,
see :mod:`areal_mega.common.moe_routes`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from areal_mega.common.moe_routes import NO_ROUTE, ROUTED_EXPERTS
from areal_mega.dataplane import Trajectory


@dataclass
class TokenSeq:
    """Growing per-token arrays of one sample."""

    input_ids: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    routed_experts: Optional[np.ndarray] = None  # rows of positions 0..n-1 (last forward wins)

    def add_context(self, ids) -> None:
        """Prompt / environment tokens: not trained on."""
        ids = list(ids)
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, ids, logprobs, versions, routed_experts=None) -> None:
        """Policy tokens with their behaviour logprobs and weight versions. ``routed_experts``:
        the generation's routes (``GenerationOutput.routed_experts``) when its input was this
        sequence so far, see :meth:`add_routes`."""
        assert len(ids) == len(logprobs) == len(versions)
        self.input_ids += list(ids)
        self.loss_mask += [1] * len(ids)
        self.logprobs += list(logprobs)
        self.versions += list(versions)
        self.add_routes(routed_experts)

    def add_routes(self, rows) -> None:
        """Routes of positions ``0 .. len(rows) - 1`` of this sequence from one generation
        (whose input started at this sequence's first token). A later call's routes replace
        the earlier ones: a later turn's prefill re-forwards the whole context, and the tokens
        it generates saw that forward (see :class:`~areal_mega.common.moe_routes.RouteTable`)."""
        if rows is None:
            return
        have = 0 if self.routed_experts is None else len(self.routed_experts)
        self.routed_experts = (
            rows if len(rows) >= have else np.concatenate([rows, self.routed_experts[len(rows) :]])
        )

    def to_trajectory(
        self,
        *,
        reward: float,
        sample_id: str,
        group_id: str,
        prompt_len: int,
        finish_reason: str,
        server_id: str = "",
        meta: Optional[dict] = None,
        multimodal: Optional[dict] = None,
    ):
        """Freeze into a :class:`Trajectory` with the data-plane dtypes (routes, when kept, as
        ``token_extras.routed_experts`` with -1 rows for tokens no server forwarded).
        ``multimodal``: the prompt's images, ``pixel_values`` / ``image_grid_thw``
        (:mod:`areal_mega.dataplane.multimodal`; numpy or CPU tensors, converted to float32 /
        int32)."""
        extras = {}
        if self.routed_experts is not None:
            r, n = self.routed_experts, len(self.input_ids)
            full = np.full((n, *r.shape[1:]), NO_ROUTE, r.dtype)
            full[: min(n, len(r))] = r[:n]
            extras[ROUTED_EXPERTS] = full
        return Trajectory(
            input_ids=np.asarray(self.input_ids, dtype=np.int32),
            loss_mask=np.asarray(self.loss_mask, dtype=np.uint8),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            reward=float(reward),
            sample_id=sample_id,
            group_id=group_id,
            prompt_len=int(prompt_len),
            finish_reason=finish_reason,
            created_at=time.time(),
            server_id=server_id,
            meta=dict(meta or {}),
            token_extras=extras,
            multimodal=dict(multimodal or {}),
        )


def prompt_ids(tokenizer, item: dict, apply_chat_template: bool = True) -> list:
    """Token ids of a prompt item (``input_ids`` as given, else the chat-templated ``prompt``)."""
    if item.get("input_ids") is not None:
        return [int(i) for i in item["input_ids"]]
    if item.get("image_data") or item.get("multimodal"):
        raise ValueError(
            "a prompt item with images needs its image-expanded input_ids (one <|image_pad|> "
            "per merged patch; PromptDataset.prompt_fields makes them)"
        )
    if tokenizer is None:
        raise ValueError("prompt item has no input_ids and no tokenizer was given")
    text = item.get("prompt")
    if not isinstance(text, str):
        raise ValueError(f"prompt item needs 'prompt' (str) or 'input_ids': {item!r:.200}")
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

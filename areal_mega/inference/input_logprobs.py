"""Input-token logprobs of the CPU rollout server, as SGLang's ``/generate`` returns them in
``meta_info.input_token_logprobs`` when ``return_logprob`` is set.

What SGLang does (``Scheduler.handle_generate_request``, ``ScheduleBatch.prepare_for_extend``
and ``SchedulerOutputProcessorMixin._process_input_token_logprobs``), and so what this module
does, for a prompt ``ids`` of length ``L`` and ``logprob_start_len`` ``k``:

- ``k == -1`` (the default) means ``k = L - 1``; ``k >= L`` is refused;
- the answer has ``L - k`` entries, one per input position ``k .. L-1``, each echoing the token
  id ``ids[t]``; the entry of position ``k`` is always ``None`` (SGLang computes, at positions
  ``k .. L-1``, the logprob of the *next* token and shifts the list right by one, dropping the
  one for the first generated token), and the entry of position ``t > k`` is
  ``log p(ids[t] | ids[:t])``. So a caller wanting logprobs from position ``s >= 1`` on asks
  for ``k = s - 1`` and drops the leading ``None``;
- the values are ``log_softmax`` of the raw logits: temperature 1 whatever the request's
  temperature (SGLang's ``Req.temp_scaled_logprobs`` is always False, and no top-p
  normalisation), unlike the output-token logprobs.

Here the values come from one plain full forward of the served model over the prompt, run on
the engine thread (``BatchedEngine.run_exclusive``) so that it never interleaves with a decode
step or a weight load.
"""

from __future__ import annotations

from typing import Optional

import torch

from areal_mega.inference.vl_model import is_vision_config, vl_forward_inputs


def resolve_start(start: int, length: int) -> int:
    """SGLang's reading of ``logprob_start_len`` for a prompt of ``length`` tokens: ``-1`` is
    ``length - 1``; anything else is kept (the caller checks the range)."""
    return length - 1 if start == -1 else start


def needs_forward(start: int, length: int) -> bool:
    """Whether a resolved ``start`` asks for any computed value (only ``None`` otherwise)."""
    return start < length - 1


@torch.no_grad()
def input_token_logprobs(
    model, prompts: list, starts: list, adapters=None, lora=None, images=None
) -> list:
    """For each prompt and its resolved start ``k``: ``[None] + [log p(ids[t] | ids[:t]) for t
    in k+1 .. L-1]`` (floats). Prompts of equal length that need values share one forward;
    no padding is ever used, so each row is what a forward of that prompt alone gives.
    ``lora``: the model's :class:`~areal_mega.inference.lora_layers.LoraLayers`, each prompt
    forwarded with its adapter of ``adapters`` (None: the base model). ``images``: a
    vision-language model's :class:`~areal_mega.inference.vl_model.PromptImages` per prompt
    (None: none), forwarded with the prompt and its multimodal positions."""
    out: list = [None] * len(prompts)
    by_len: dict = {}
    for i, (ids, k) in enumerate(zip(prompts, starts)):
        if needs_forward(k, len(ids)):
            by_len.setdefault(len(ids), []).append(i)
        else:
            out[i] = [None]
    for rows in by_len.values():
        ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long)
        if lora is not None:
            lora.set_rows([None if adapters is None else adapters[i] for i in rows])
        if is_vision_config(model.config):
            kwargs, _ = vl_forward_inputs(
                model, ids, [None if images is None else images[i] for i in rows]
            )
            logits = model(**kwargs).logits.float()
        else:
            logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        picked = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]: p(ids[t+1])
        for b, i in enumerate(rows):
            k = starts[i]
            values: list[Optional[float]] = [None]
            values.extend(picked[b, k:].tolist())
            out[i] = values
    return out

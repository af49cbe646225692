"""String rewards for tasks whose answer is one exact string (the synthetic tasks of
:mod:`areal_mega.data.synthetic`): :func:`exact_match_reward` and its dense partial-credit
twin :func:`char_match_reward`."""

from __future__ import annotations

from typing import Any, Optional

DEFAULT_EOS_TOKEN = "<eos>"


def exact_match_reward(
    prompt: str,
    completion: str,
    answer: Any,
    *,
    finish_reason: Optional[str] = None,
    eos_token: str = DEFAULT_EOS_TOKEN,
    **kw,
) -> float:
    """1.0 for exactly ``answer`` followed by EOS or the end of the completion, else 0.0.

    The completion may carry the EOS token as text (``"21384<eos>"``, decoded without skipping
    special tokens) or not (``"21384"``, the server stopped on EOS). A completion cut by the
    length limit (``finish_reason == "length"``) or aborted scores 0 even if its text matches,
    since the model never ended it. Surrounding whitespace is not forgiven.
    """
    if completion is None:
        return 0.0
    text = completion
    ended_with_eos = False
    if eos_token and text.endswith(eos_token):
        text = text[: -len(eos_token)]
        ended_with_eos = True
    if not ended_with_eos and finish_reason in ("length", "abort"):
        return 0.0
    return 1.0 if text == str(answer) else 0.0


def char_match_reward(
    prompt: str,
    completion: str,
    answer: Any,
    *,
    finish_reason: Optional[str] = None,
    eos_token: str = DEFAULT_EOS_TOKEN,
    **kw,
) -> float:
    """Partial credit: the fraction of positions where the completion (EOS removed) matches
    the answer, over the longer of the two. Dense where :func:`exact_match_reward` is sparse,
    so even an untrained model gets a learning signal."""
    text = completion or ""
    if eos_token and text.endswith(eos_token):
        text = text[: -len(eos_token)]
    want = str(answer)
    if not want and not text:
        return 1.0
    hits = sum(a == b for a, b in zip(text, want))
    return hits / max(len(text), len(want))

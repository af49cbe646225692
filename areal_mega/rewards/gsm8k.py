"""GSM8K answers: the number after the last ``####``."""

from __future__ import annotations

import re
from typing import Optional

_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_LAST_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_gsm8k_answer(text: str) -> Optional[str]:
    """The number after the last ``####`` (GSM8K's answer marker), commas removed; when there
    is no marker, the last number in the text. None when there is no number."""
    found = _GSM8K_ANSWER.findall(text or "")
    if not found:
        found = _LAST_NUMBER.findall(text or "")
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value.rstrip(".") or None


def gsm8k_reward(prompt: str, completion: str, answer, **kw) -> float:
    """1.0 when the completion's final number (:func:`extract_gsm8k_answer`) equals the
    reference's (a GSM8K solution ending in ``#### 42``, or a bare number), else 0.0."""
    got = extract_gsm8k_answer(completion)
    want = extract_gsm8k_answer(str(answer))
    if got is None or want is None:
        return 0.0
    try:
        return 1.0 if float(got) == float(want) else 0.0
    except ValueError:
        return 1.0 if got == want else 0.0

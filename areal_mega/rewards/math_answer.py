"""Math answers: :func:`math_reward` checks the last ``\\boxed{...}`` of a completion
against the reference answer with ``math-verify``. Parsing and verification run in a worker
process with a hard timeout (:mod:`areal_mega.rewards.worker_pool`): a pathological expression
gets reward 0 and its worker is killed and replaced, so it can never hang a rollout worker."""

from __future__ import annotations

import logging
from typing import Optional

from areal_mega.rewards.worker_pool import shared_pool

log = logging.getLogger(__name__)


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
                j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


def _verify_math(completion: str, answer: str, inner_timeout: int) -> float:
    """Runs in the worker process (main thread: math-verify's own signal timeouts work)."""
    from math_verify import parse, verify

    boxed = extract_boxed(completion)
    if boxed is None:
        return 0.0
    gold = parse(
        f"${answer}$" if "$" not in str(answer) else str(answer), parsing_timeout=inner_timeout
    )
    pred = parse(f"$\\boxed{{{boxed}}}$", parsing_timeout=inner_timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=inner_timeout) else 0.0


def math_reward(prompt: str, completion: str, answer, timeout_s: float = 10.0, **kw) -> float:
    """1.0 if the last ``\\boxed{}`` of ``completion`` equals ``answer`` (math-verify), else
    0.0; 0.0 on timeout (the worker is killed) or on any verifier error."""
    if completion is None or answer is None or "\\boxed" not in completion:
        return 0.0
    inner = max(1, int(timeout_s) - 1)
    try:
        return float(
            shared_pool().call(
                "areal_mega.rewards.math_answer:_verify_math",
                (completion, str(answer), inner),
                timeout_s,
            )
        )
    except (TimeoutError, RuntimeError) as e:
        log.warning("math_reward: %s", e)
        return 0.0

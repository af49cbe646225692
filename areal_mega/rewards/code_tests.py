"""Code rewards: the completion's last fenced python block runs on APPS/TACO-style tests in
the sandbox (:mod:`areal_mega.rewards.sandbox`)."""

from __future__ import annotations

import json
import logging
import re
from typing import Optional

from areal_mega.rewards.sandbox import default_sandbox

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> Optional[str]:
    """The last fenced python block of ``completion`` (```python / ```py / ```python3, else
    the last unlabelled ``` block), or None."""
    blocks = _FENCE.findall(completion or "")
    labelled = [code for lang, code in blocks if lang]
    pool = labelled or [code for lang, code in blocks]
    return pool[-1] if pool else None


def parse_code_tests(answer) -> dict:
    """APPS/TACO tests from a dict or its JSON string: ``inputs``, ``outputs`` (equal-length
    lists), optional ``fn_name``; raises ``ValueError`` naming the problem."""
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"code tests: answer is not valid JSON ({e.msg})") from None
    if not isinstance(answer, dict):
        raise ValueError(f"code tests: expected a mapping, got {type(answer).__name__}")
    for key in ("inputs", "outputs"):
        if not isinstance(answer.get(key), list):
            raise ValueError(f"code tests: {key!r} must be a list")
    if len(answer["inputs"]) != len(answer["outputs"]) or not answer["inputs"]:
        raise ValueError(
            f"code tests: {len(answer['inputs'])} inputs but "
            f"{len(answer['outputs'])} outputs (need equal, non-zero counts)"
        )
    fn_name = answer.get("fn_name")
    if fn_name is not None and not isinstance(fn_name, str):
        raise ValueError("code tests: 'fn_name' must be a string")
    return {"inputs": answer["inputs"], "outputs": answer["outputs"], "fn_name": fn_name}


def code_reward(
    prompt: str,
    completion: str,
    answer,
    *,
    timeout_s: float = 4.0,
    all_or_nothing: bool = False,
    memory_mb: int = 1024,
    max_procs: int = 32,
    max_file_mb: int = 32,
    **kw,
) -> float:
    """Run the completion's last fenced python block on the tests in ``answer`` (APPS/TACO
    convention, see :func:`parse_code_tests`) in the sandbox (:mod:`areal_mega.rewards.sandbox`).

    Returns the fraction of tests passed, or 1.0/0.0 with ``all_or_nothing`` (the run stops
    at the first failure). No code block, bad tests or a sandbox failure give 0.0, never an
    exception. ``timeout_s`` is the wall and CPU limit per test."""
    code = extract_code(completion)
    if code is None:
        return 0.0
    try:
        tests = parse_code_tests(answer)
        res = default_sandbox().run(
            code,
            tests,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            max_procs=max_procs,
            max_file_mb=max_file_mb,
            stop_at_first_failure=all_or_nothing,
        )
    except (ValueError, TypeError, OSError) as e:  # bad tests or no process: score 0
        log.warning("code_reward: %s", e)
        return 0.0
    if all_or_nothing:
        return 1.0 if res.passed == res.total else 0.0
    return res.fraction

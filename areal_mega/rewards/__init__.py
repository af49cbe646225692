"""Reward functions, and the loader that finds one by the name a config gives.

Signature of every reward function: ``fn(prompt: str, completion: str, answer, **kw) -> float``
(``kw`` carries ``finish_reason`` and the sample's metadata). ``rollout.reward_fn`` names one as
``"package.module:function"``, ``"path/to/file.py:function"`` or ``package.module.function``.

- :func:`math_reward` (:mod:`.math_answer`): ``\\boxed{}`` answers checked with math-verify in
  a worker process with a hard timeout (:mod:`.worker_pool`);
- :func:`code_reward` (:mod:`.code_tests`): APPS/TACO tests in the sandbox (:mod:`.sandbox`);
- :func:`gsm8k_reward` (:mod:`.gsm8k`): ``#### 42`` answers;
- :func:`exact_match_reward`, :func:`char_match_reward` (:mod:`.string_match`): one exact
  string, followed by EOS;
- :mod:`.sandbox_runner`: the process inside the code sandbox (run by :mod:`.sandbox`, never
  imported).

:func:`load_reward_fn` (here) loads the function a config names.
"""

from __future__ import annotations

from typing import Callable

from areal_mega.common.loading import load_object
from areal_mega.rewards.code_tests import code_reward, extract_code, parse_code_tests
from areal_mega.rewards.gsm8k import extract_gsm8k_answer, gsm8k_reward
from areal_mega.rewards.math_answer import extract_boxed, math_reward
from areal_mega.rewards.string_match import char_match_reward, exact_match_reward
from areal_mega.rewards.worker_pool import TimeoutWorkerPool, shutdown_reward_workers


def load_reward_fn(spec: str) -> Callable:
    """The reward function ``spec`` names (see the module docstring); raises ``ValueError``
    naming ``reward_fn`` and what is wrong."""
    fn = load_object(spec, "reward_fn", dotted_ok=True)
    if not callable(fn):
        raise ValueError(f"reward_fn={spec!r}: {fn!r} is not callable")
    return fn


__all__ = [
    "TimeoutWorkerPool",
    "char_match_reward",
    "code_reward",
    "exact_match_reward",
    "extract_boxed",
    "extract_code",
    "extract_gsm8k_answer",
    "gsm8k_reward",
    "load_reward_fn",
    "math_reward",
    "parse_code_tests",
    "shutdown_reward_workers",
]

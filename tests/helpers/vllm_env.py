"""The vLLM interpreter of the tests that run real vLLM code (its own venv, ``make vllm-env``).

``make test`` builds ``.venv-vllm`` first and sets ``AREAL_REQUIRE_VLLM=1``, so there (and on
a CI that sets ``CI``) a missing interpreter fails the test; elsewhere (pytest run by hand
without the env) the test is skipped, saying how to build it.
"""

from __future__ import annotations

import os

import pytest

from areal_mega.backends.vllm.launch import resolve_vllm_python


def vllm_python() -> str:
    """``$AREAL_VLLM_PYTHON`` or the repository's ``.venv-vllm/bin/python`` when it exists."""
    python = resolve_vllm_python("")
    if os.access(python, os.X_OK):
        return python
    why = f"no vLLM interpreter at {python} (make vllm-env builds it)"
    if os.environ.get("CI") or os.environ.get("AREAL_REQUIRE_VLLM") == "1":
        pytest.fail(why + "; `make test` should have built it")
    pytest.skip(why)

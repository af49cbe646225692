"""Helpers shared by the rollout tests: tiny models, server processes, teacher-forced logprobs."""
from __future__ import annotations

import asyncio

import pytest
import torch

from areal_mega.models.tiny import make_tiny_model

API_KEY = "test-key"


def make_models(tmp_path_factory):
    """Two tiny llama models with the same shapes and different weights."""
    base = tmp_path_factory.mktemp("rollout_models")
    a = make_tiny_model(base / "a", arch="llama", hidden_size=64, num_layers=2, seed=0)
    b = make_tiny_model(base / "b", arch="llama", hidden_size=64, num_layers=2, seed=1)
    return a, b


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The two tiny models as paths (``a``, ``b``) and loaded transformers models (``ma``,
    ``mb``); test modules import this fixture."""
    a, b = make_models(tmp_path_factory)
    return {"a": a, "b": b, "ma": load_model(a), "mb": load_model(b)}


def load_model(path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced_logprobs(model, ids, start, temperature=1.0):
    """log p(ids[t] | ids[:t]) for t >= start, at ``temperature``."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return [float(lp[t - 1, ids[t]]) for t in range(start, len(ids))]


def run(coro, timeout=120):
    """Run ``coro`` on a fresh event loop with a timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))

"""Checks of a loaded config against the model it names, run before any work starts.

:func:`~areal_mega.config.load_config` checks the config on its own (keys, types, ranges,
combinations); :func:`check_against_model` checks it against the model directory, where one
exists: a rollout whose prompt and completion cannot fit the model's context would only fail
later, request by request, on the rollout servers. No torch, no megatron: the launcher, the
trainer and the demo call it first thing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from areal_mega.config import ConfigError


def model_context(model_path: str) -> Optional[tuple]:
    """``(max_position_embeddings, config.json path)`` of an HF model directory, or None when
    the directory has no config.json or it declares no context length (then nothing can be
    checked). Raises :class:`ConfigError` naming the file when it is not a JSON object."""
    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={model_path!r}: {path} is unreadable: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.path={model_path!r}: {path} is not a JSON object")
    for section in (hf, hf.get("text_config")):  # multimodal configs nest the text model
        n = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, path
    return None


def check_against_model(cfg) -> None:
    """Raise one :class:`ConfigError` naming the keys when, in RL mode, the longest prompt the
    data may hold plus the generation budget (``data.max_prompt_len +
    rollout.max_new_tokens``) exceeds the context of ``model.path`` (``max_position_embeddings``
    of its ``config.json``). Does nothing when the model's context is unknown."""
    if cfg.mode != "rl":
        return
    known = model_context(cfg.model.path)
    if known is None:
        return
    context, path = known
    need = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if need > context:
        raise ConfigError(
            f"data.max_prompt_len={cfg.data.max_prompt_len} + rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} = {need} tokens exceeds the model's context of "
            f"{context} (max_position_embeddings in {path}): every such request would be "
            "rejected by the rollout servers; lower data.max_prompt_len or "
            "rollout.max_new_tokens")

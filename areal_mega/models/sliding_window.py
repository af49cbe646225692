"""Sliding-window attention (Mistral): the config key, megatron's window and the masks.

Semantics are transformers' (``masking_utils.sliding_window_overlay``): with window ``W`` the
query at position ``i`` sees the keys at positions ``j`` with ``i - W < j <= i``, i.e. the
``W`` most recent tokens including itself. megatron-core (and TransformerEngine) express the
same window as ``window_size = (W - 1, 0)`` (tokens to the left, tokens to the right), which is
also what Megatron-Bridge's Mistral provider sets from ``sliding_window``.

Pure torch: used by the trainer's packed attention and by the rollout server's KV cache.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SLIDING_WINDOW_MODEL_TYPES", "hf_sliding_window", "mcore_window_size", "window_visible"]

#: model types whose ``sliding_window`` applies to every layer (no ``use_sliding_window``
#: switch, no per-layer pattern); ``sliding_window: null`` means full attention
SLIDING_WINDOW_MODEL_TYPES = ("mistral",)


def hf_sliding_window(cfg: dict) -> Optional[int]:
    """The attention window ``W`` of an HF config dict (None: full causal attention).

    Only :data:`SLIDING_WINDOW_MODEL_TYPES` read ``sliding_window``: Qwen2/Qwen3 configs carry
    the key too but apply it only with ``use_sliding_window`` (refused by the builder)."""
    if cfg.get("model_type") not in SLIDING_WINDOW_MODEL_TYPES:
        return None
    w = cfg.get("sliding_window")
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"sliding_window={w!r}: must be a positive integer or null")
    return w


def mcore_window_size(window: Optional[int]) -> Optional[tuple]:
    """megatron's ``TransformerConfig.window_size`` of HF window ``window``."""
    return None if window is None else (window - 1, 0)


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Boolean ``[len(q_pos), len(k_pos)]``: True where the query at position ``q_pos[a]`` may
    attend to the key at position ``k_pos[b]`` (causal, and inside the window if any)."""
    d = q_pos.view(-1, 1) - k_pos.view(1, -1)
    visible = d >= 0
    if window is not None:
        visible &= d < window
    return visible

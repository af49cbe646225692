"""The sliding-window helpers (areal_mega/models/sliding_window.py): the config key, megatron's
window and the visibility mask, against transformers' own mask."""

import pytest
import torch

from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf
from areal_mega.models.sliding_window import hf_sliding_window, mcore_window_size, window_visible

MISTRAL = dict(
    model_type="mistral",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=64,
    max_position_embeddings=128,
)


@pytest.mark.parametrize(
    "cfg,want",
    [
        (dict(model_type="mistral", sliding_window=4096), 4096),
        (dict(model_type="mistral", sliding_window=None), None),  # many Mistral checkpoints
        (dict(model_type="mistral"), None),
        (dict(model_type="mistral", sliding_window=1), 1),
        # Qwen2 carries the key but applies it only with use_sliding_window (refused elsewhere)
        (dict(model_type="qwen2", sliding_window=4096), None),
    ],
)
def test_hf_sliding_window(cfg, want):
    assert hf_sliding_window(cfg) == want


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4096"])
def test_hf_sliding_window_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="sliding_window"):
        hf_sliding_window(dict(model_type="mistral", sliding_window=bad))


def test_mcore_window_size_is_bridge_convention():
    assert mcore_window_size(None) is None
    assert mcore_window_size(4096) == (4095, 0)
    assert mcore_window_size(1) == (0, 0)


@pytest.mark.parametrize("window", [None, 1, 3, 7, 20])
def test_window_visible_equals_transformers_mask(window):
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    q, k = torch.arange(4, 11), torch.arange(11)  # 7 queries after 4 cached keys
    want = torch.tensor([[bool(fn(0, 0, i, j)) for j in k] for i in q])
    assert torch.equal(window_visible(q, k, window), want)


def test_mistral_arch_and_config():
    arch = parse_hf_config(dict(MISTRAL, sliding_window=16))
    assert arch.head_dim == 12 and arch.sliding_window == 16 and not arch.qkv_bias
    cfg = transformer_config_from_hf(arch)
    assert cfg.kv_channels == 12 and tuple(cfg.window_size) == (15, 0)
    null = parse_hf_config(dict(MISTRAL, sliding_window=None))
    assert null.sliding_window is None and transformer_config_from_hf(null).window_size is None
    with pytest.raises(ValueError, match="mlp_bias"):
        parse_hf_config(dict(MISTRAL, mlp_bias=True))

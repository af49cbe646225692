"""The decoder facts every HF causal-LM config states the same way: sizes, heads, RoPE base,
norm epsilon, tied embeddings. Each family's ``*_arch_fields`` starts from these and adds its
own; only the defaults (what a config that omits the key means for that family, as its
transformers config class says) differ between families."""

from typing import Any, Optional


def decoder_fields(
    hf: dict,
    *,
    model_type: str,
    max_position_embeddings: int,
    rms_norm_eps: float,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10_000.0,
    initializer_range: float = 0.02,
    eps_key: str = "rms_norm_eps",
    head_dim: Optional[int] = None,
) -> dict[str, Any]:
    """Pure: the common :class:`~areal_mega.models.builder.HFArch` fields of the config dict
    ``hf``. The keyword values are the family's defaults for keys the config leaves out
    (``rope_theta`` is read from the top level, then from ``rope_parameters`` /
    ``rope_scaling``); ``eps_key`` names the config's norm epsilon key; ``head_dim`` overrides
    ``hf["head_dim"] or hidden_size // num_attention_heads`` for families that compute it."""
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim if head_dim is not None else hf.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", max_position_embeddings)),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", rope_theta))),
        rms_norm_eps=float(hf.get(eps_key, rms_norm_eps)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tie_word_embeddings)),
        initializer_range=float(hf.get("initializer_range", initializer_range)),
    )

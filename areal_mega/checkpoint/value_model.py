"""HF reward/value models as the critic's starting point: ``*ForSequenceClassification``.

transformers' sequence-classification models (``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``, ...) are the causal LM's body (``model.*``, the same
tensor names) with ``score = Linear(hidden_size, num_labels, bias=False)`` in place of
``lm_head``: a checkpoint holds ``score.weight`` [num_labels, H] and no ``lm_head.weight``.
With one label, ``score`` applied at every position is a per-token value, the critic's
value head (:func:`areal_mega.engine.critic.load_score_head`); its body converts like the
LM's trunk (:func:`areal_mega.checkpoint.convert.convert_hf_to_mcore` with
``value_model=True``). Pure config logic here, no torch.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "SCORE_TENSOR",
    "SEQ_CLS_SUFFIX",
    "is_sequence_classification",
    "hf_num_labels",
    "value_model_problem",
]

#: The one-label head's tensor in a sequence-classification checkpoint.
SCORE_TENSOR = "score.weight"
SEQ_CLS_SUFFIX = "ForSequenceClassification"


def is_sequence_classification(architectures: Optional[Sequence[str]]) -> bool:
    """Whether an HF config's ``architectures`` name a sequence-classification model."""
    return any(str(a).endswith(SEQ_CLS_SUFFIX) for a in architectures or ())


def hf_num_labels(cfg: dict) -> int:
    """``num_labels`` as transformers reads it from ``config.json``: the size of
    ``id2label`` when present, else ``num_labels``, else transformers' default of 2."""
    if cfg.get("id2label"):
        return len(cfg["id2label"])
    if cfg.get("num_labels") is not None:
        return int(cfg["num_labels"])
    return 2


def value_model_problem(cfg: dict, causal_lm_architectures: Sequence[str]) -> Optional[str]:
    """Why the HF config ``cfg`` cannot start a value model, or None when it can: its
    ``architectures`` are the family's causal LM (``causal_lm_architectures``; the trunk
    only, fresh head) or the matching ``*ForSequenceClassification`` with one label."""
    allowed = {
        a[: -len("ForCausalLM")] + SEQ_CLS_SUFFIX
        for a in causal_lm_architectures
        if a.endswith("ForCausalLM")
    }
    archs = list(cfg.get("architectures") or [])
    bad = [a for a in archs if a not in allowed and a not in causal_lm_architectures]
    if bad:
        return (
            f"architectures={bad} is neither a causal LM nor a sequence-classification "
            f"model of model_type {cfg.get('model_type')!r} (expected one of "
            f"{sorted(set(causal_lm_architectures) | allowed)})"
        )
    if is_sequence_classification(archs) and hf_num_labels(cfg) != 1:
        return (
            f"{archs[0]} has num_labels={hf_num_labels(cfg)} (id2label="
            f"{cfg.get('id2label')}); a value model needs num_labels=1 (one score per "
            f"token)"
        )
    return None

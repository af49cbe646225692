"""Where a checkpoint tensor goes in the rollout server's transformers model.

Weight updates arrive with HF checkpoint names (from disk, or broadcast by the trainer). For
most tensors the name is the model's own parameter. transformers 5 stores the experts of an
MoE block fused, as it converts them when loading (its ``qwen2_moe`` conversion mapping, used
by qwen3_moe and many others): ``<layer>.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` with
expert e's ``gate_proj`` in rows ``0..I-1`` and its ``up_proj`` in rows ``I..2I-1``, and
``<layer>.mlp.experts.down_proj`` ``[E, H, I]``. A checkpoint's per-expert tensor
``<layer>.mlp.experts.<e>.(gate|up|down)_proj.weight`` is therefore a slice of a fused
parameter; :class:`ParamTargets` resolves every name to ``(parameter name, index)``.

Some families' checkpoints also name tensors otherwise than their modules, which transformers
renames on load (its ``WeightRenaming`` entries for the model type, e.g. HY-V3's
``mlp.router.gate.weight`` -> ``mlp.gate.weight``, ``mlp.expert_bias`` ->
``mlp.e_score_correction_bias``, ``mlp.shared_mlp.`` -> ``mlp.shared_experts.``): a name that is
not the model's own is resolved after those renamings (:func:`checkpoint_renames`).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


_FUSED_PARTS = {
    ".experts.gate_up_proj": ("gate_proj", "up_proj"),
    ".experts.down_proj": ("down_proj",),
}
_PER_EXPERT = re.compile(r"^\.experts\.\*\.(\w+)\.weight$")


def checkpoint_renames(model_type: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    """``(regex, replacement)`` pairs of transformers' checkpoint renamings for ``model_type``
    (a model type or, as transformers looks them up first, a model class name; its conversion
    mapping's ``WeightRenaming`` entries), and the per-expert names its expert
    fusions read under other names (MiniMax-M2's ``experts.<e>.w1`` / ``w3`` / ``w2`` fused
    into ``gate_up_proj`` / ``down_proj``) renamed to ``gate_proj`` / ``up_proj`` /
    ``down_proj``; the fusions themselves are :class:`ParamTargets`' own."""
    if not model_type:
        return ()
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    out = []
    for t in get_checkpoint_conversion_mapping(model_type) or ():
        if type(t) is WeightRenaming:
            out.extend(zip(t.source_patterns, t.target_patterns))
        elif type(t) is WeightConverter and len(t.target_patterns) == 1:
            parts = _FUSED_PARTS.get(t.target_patterns[0], ())
            sources = [_PER_EXPERT.match(p) for p in t.source_patterns]
            if len(sources) == len(parts) and all(sources):
                out.extend(
                    (rf"\.experts\.(\d+)\.{m.group(1)}\.weight$", rf".experts.\1.{part}.weight")
                    for m, part in zip(sources, parts)
                    if m.group(1) != part
                )
    return tuple(out)


class ParamTargets:
    """Name resolution against ``state_dict`` (the model's tensors by name); ``renames``:
    :func:`checkpoint_renames` of the model's type, applied to names the model does not
    have."""

    def __init__(self, state_dict: dict, renames: Sequence[Tuple[str, str]] = ()):
        self.sd = state_dict
        self.renames = tuple((re.compile(src), dst) for src, dst in renames)
        self.pieces: dict = {}  # fused parameter name -> how many slices make it whole
        for name, t in state_dict.items():
            if name.endswith(".mlp.experts.gate_up_proj") and t.dim() == 3:
                self.pieces[name] = 2 * t.shape[0]
            elif name.endswith(".mlp.experts.down_proj") and t.dim() == 3:
                self.pieces[name] = t.shape[0]

    def target(self, name: str) -> Optional[tuple]:
        """``(parameter name, index)`` of checkpoint tensor ``name`` (index ``()`` for a whole
        parameter), or None when the model has no place for it."""
        if name in self.sd:
            return name, ()
        for src, dst in self.renames:
            name = src.sub(dst, name)
        if name in self.sd:
            return name, ()
        m = _EXPERT.match(name)
        if m is None:
            return None
        base, e, which = m.group(1), int(m.group(2)), m.group(3)
        param = base + (".down_proj" if which == "down_proj" else ".gate_up_proj")
        if param not in self.pieces or e >= self.sd[param].shape[0]:
            return None
        if which == "down_proj":
            return param, (e,)
        half = self.sd[param].shape[1] // 2
        return param, (e, slice(0, half) if which == "gate_proj" else slice(half, 2 * half))

    def view(self, name: str):
        """The model tensor (or slice of one) that checkpoint tensor ``name`` is copied into."""
        param, index = self.target(name)
        return self.sd[param][index] if index else self.sd[param]

    def missing(self, names, required) -> list:
        """The ``required`` parameters that ``names`` (a whole checkpoint) do not fill
        entirely."""
        count: dict = {}
        for n in names:
            t = self.target(n)
            if t is not None:
                count[t[0]] = count.get(t[0], 0) + (1 if t[1] else self.pieces.get(t[0], 1))
        return sorted(p for p in required if count.get(p, 0) < self.pieces.get(p, 1))

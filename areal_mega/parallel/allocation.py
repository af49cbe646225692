"""Allocation strings: ``<rollout>:<dims>+<trainer>:<dims>`` (pure; no torch.distributed).

Examples: ``sglang:d4t2+megatron:d2p2t2c1e2``, ``vllm:d2t2+megatron:t2``,
``local:d1+megatron:t2``, ``megatron:t2p2``
(trainer only, joining external rollout servers).

Letters: ``d`` data, ``t`` tensor, ``p`` pipeline, ``c`` context, ``e`` expert parallel size
(default 1). Trainer world = d·t·p·c; ``e`` adds no ranks (experts are carved out of d·c) and
must divide d·c. Rollout world = d·t·p.

MoE parallel folding (the experts' own tensor parallel size, AReaL's hybrid form):
``megatron:(attn:d1t2p1c1|ffn:d2t1p1e1)``. ``attn`` lays out the attention and every dense
layer (letters d/t/p/c, the world as above); ``ffn`` lays out the routed experts on the same
ranks (letters d/t/p/e): its ``t`` is the expert tensor parallel size, ``e`` the expert
parallel size, ``d`` the expert data parallel size (optional: the rest of the world), ``p``
(optional) must equal attn's. Its world d·t·p·e is attn's world. Experts at tensor parallel 1
beside attention at TP 2 is the usual choice for MoE models (and the only one megatron-core
allows for experts with biases). ``e`` must divide the ranks of one stage over the experts'
``t``: d·t·c / t_ffn.

Pure parsing with no side effects; any process may call it: config validation
(:func:`areal_mega.config.validate`), the launcher's plan (``areal_mega.launch.plan``),
the weight-update group (``areal_mega.parallel.weight_group``) and every trainer rank building
its mesh (``TrainerSession``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

ROLLOUT_BACKENDS = ("sglang", "vllm", "local")
TRAINER_BACKENDS = ("megatron",)
_DIM_NAMES = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
_ROLLOUT_LETTERS = "dtp"
_TRAINER_LETTERS = "dtpce"


class AllocationError(ValueError):
    """An allocation string that breaks a rule; the message names the letter and the rule."""


def expert_tp_size(tp: int, etp: Optional[int]) -> int:
    """The routed experts' tensor parallel size: ``etp``, or ``tp`` where it is None (the
    experts take the attention's TP unless the allocation gives them their own)."""
    return tp if etp is None else etp


@dataclass(frozen=True)
class ParallelDims:
    """Parallel sizes of one side (all >= 1): ``dp`` data, ``tp`` tensor, ``pp`` pipeline,
    ``cp`` context, ``ep`` expert (trainer only; carved out of dp·cp, so it adds no ranks).
    The rollout side uses dp/tp/pp only and keeps cp = ep = 1. ``etp``: the routed experts'
    tensor parallel size (trainer only; None, or equal to ``tp``: the experts split by ``tp``,
    megatron's default)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None

    def __post_init__(self):
        if self.etp == self.tp:  # one spelling per layout: equal sizes are the default
            object.__setattr__(self, "etp", None)

    @property
    def expert_tp(self) -> int:
        """The routed experts' tensor parallel size (``etp``, else ``tp``)."""
        return expert_tp_size(self.tp, self.etp)

    @property
    def expert_dp(self) -> int:
        """Ranks of one pipeline stage holding the same experts: d·t·c / (expert TP·EP)."""
        return self.dp * self.tp * self.cp // (self.expert_tp * self.ep)

    @property
    def world_size(self) -> int:
        """Ranks this layout needs: dp·tp·pp·cp (``ep`` adds none)."""
        return self.dp * self.tp * self.pp * self.cp

    def short(self) -> str:
        """Every size in allocation-string form, e.g. ``d2t2p1c1e1`` (for messages, logs); the
        hybrid form ``(attn:d1t2p1c1|ffn:d2t1p1e1)`` when the experts' TP differs from TP."""
        attn = f"d{self.dp}t{self.tp}p{self.pp}c{self.cp}"
        if self.etp is None:
            return f"{attn}e{self.ep}"
        return f"(attn:{attn}|ffn:d{self.expert_dp}t{self.etp}p{self.pp}e{self.ep})"


@dataclass(frozen=True)
class Allocation:
    """A parsed allocation string. ``rollout_backend`` (``sglang``/``vllm``/``local``) and
    ``rollout`` are None for a trainer-only string (the trainer joins external rollout
    servers); ``trainer_backend`` is ``megatron``; ``trainer`` holds the trainer's sizes."""

    rollout_backend: Optional[str]
    rollout: Optional[ParallelDims]
    trainer_backend: str
    trainer: ParallelDims

    @property
    def rollout_world_size(self) -> int:
        """Devices of the rollout side: d·t·p (0 for a trainer-only allocation)."""
        return self.rollout.dp * self.rollout.tp * self.rollout.pp if self.rollout else 0

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks: d·t·p·c."""
        return self.trainer.world_size

    def canonical(self) -> str:
        """The allocation string with every letter written out, e.g.
        ``sglang:d2t4p1c1e1+megatron:d1t1p1c1e1`` (for messages)."""
        r = f"{self.rollout_backend}:{self.rollout.short()}+" if self.rollout else ""
        return f"{r}{self.trainer_backend}:{self.trainer.short()}"


_PART = re.compile(r"^([a-z_]+):(.*)$")
_DIM = re.compile(r"([a-z])(\d+)")


def _parse_letters(part: str, dims: str, allowed: str) -> dict:
    """``dims`` (``d2t2``) as {letter: size}, the letters given only."""
    if not dims:
        raise AllocationError(f"{part!r}: no dimensions after ':' (e.g. d2t2)")
    pos, values = 0, {}
    for m in _DIM.finditer(dims):
        if m.start() != pos:
            break
        letter, num = m.group(1), m.group(2)
        if letter not in _DIM_NAMES:
            raise AllocationError(
                f"{part!r}: unknown letter '{letter}'; letters are "
                + ", ".join(f"{k} ({v})" for k, v in _DIM_NAMES.items())
            )
        if letter not in allowed:
            raise AllocationError(
                f"{part!r}: letter '{letter}' ({_DIM_NAMES[letter]} parallel) "
                f"is not allowed here; allowed: {', '.join(allowed)}"
            )
        if letter in values:
            raise AllocationError(f"{part!r}: letter '{letter}' given twice")
        size = int(num)
        if size < 1:
            raise AllocationError(
                f"{part!r}: '{letter}' ({_DIM_NAMES[letter]} parallel size) "
                f"must be >= 1, got {size}"
            )
        values[letter] = size
        pos = m.end()
    if pos != len(dims):
        raise AllocationError(
            f"{part!r}: cannot parse {dims[pos:]!r}; expected letter+number pairs such as d2t2p1"
        )
    return values


def _parse_dims(part: str, dims: str, allowed: str) -> ParallelDims:
    values = _parse_letters(part, dims, allowed)
    return ParallelDims(
        dp=values.get("d", 1),
        tp=values.get("t", 1),
        pp=values.get("p", 1),
        cp=values.get("c", 1),
        ep=values.get("e", 1),
    )


_HYBRID = re.compile(r"^\((.*)\)$")
_ATTN_LETTERS = "dtpc"
_FFN_LETTERS = "dtpe"


def _parse_hybrid(part: str, inner: str) -> ParallelDims:
    """``attn:<dims>|ffn:<dims>`` (the text inside a trainer's parentheses): attention's layout
    and the experts' on the same ranks (see the module docstring)."""
    sections = {}
    for section in inner.split("|"):
        m = _PART.match(section.strip())
        if not m or m.group(1) not in ("attn", "ffn"):
            raise AllocationError(
                f"{part!r}: the parentheses hold 'attn:<dims>|ffn:<dims>', got {section.strip()!r}"
            )
        if m.group(1) in sections:
            raise AllocationError(f"{part!r}: '{m.group(1)}' given twice")
        sections[m.group(1)] = m.group(2)
    if set(sections) != {"attn", "ffn"}:
        raise AllocationError(f"{part!r}: the parentheses need both 'attn:<dims>' and 'ffn:<dims>'")
    attn = _parse_letters(part, sections["attn"], _ATTN_LETTERS)
    ffn = _parse_letters(part, sections["ffn"], _FFN_LETTERS)
    dims = ParallelDims(
        dp=attn.get("d", 1),
        tp=attn.get("t", 1),
        pp=attn.get("p", 1),
        cp=attn.get("c", 1),
        ep=ffn.get("e", 1),
        etp=ffn.get("t", 1),
    )
    if ffn.get("p", dims.pp) != dims.pp:
        raise AllocationError(
            f"{part!r}: ffn's 'p' ({ffn['p']}) must equal attn's ({dims.pp}): the experts sit in "
            "the layers of their pipeline stage"
        )
    stage = dims.world_size // dims.pp
    per_replica = dims.expert_tp * dims.ep
    if stage % per_replica:
        raise AllocationError(
            f"{part!r}: ffn's t·e = {dims.expert_tp}·{dims.ep} = {per_replica} must divide the "
            f"ranks of a pipeline stage, d·t·c = {dims.dp}·{dims.tp}·{dims.cp} = {stage}"
        )
    if "d" in ffn and ffn["d"] * per_replica != stage:
        raise AllocationError(
            f"{part!r}: ffn's world d·t·p·e = {ffn['d']}·{dims.expert_tp}·{dims.pp}·{dims.ep} = "
            f"{ffn['d'] * per_replica * dims.pp} must equal attn's d·t·p·c = {dims.world_size} "
            f"(the experts run on the same ranks; 'd' may be left out)"
        )
    return dims


def parse_allocation(text: str) -> Allocation:
    """Parse and validate an allocation string into an :class:`Allocation`.

    ``text`` is ``<rollout>:<dims>+<trainer>:<dims>`` or ``<trainer>:<dims>``; omitted letters
    are 1. Raises :class:`AllocationError` naming the part and the rule for: an empty string,
    more than two parts, a part without ``backend:dims``, an unknown backend, an unknown,
    repeated, zero or side-inappropriate letter (rollout allows d/t/p, trainer d/t/p/c/e),
    unparsable text, or ``e`` not dividing d·c; in the hybrid form ``(attn:...|ffn:...)`` also a
    missing or unknown section, ffn's ``p`` unlike attn's, its ``t·e`` not dividing a stage's
    ranks or its world unlike attn's. Pure; no side effects.
    """
    if not isinstance(text, str) or not text.strip():
        raise AllocationError("empty allocation string; expected e.g. 'local:d1+megatron:t2'")
    parts = [p.strip() for p in text.strip().split("+")]
    if len(parts) > 2:
        raise AllocationError(f"{text!r}: at most two parts '<rollout>:<dims>+<trainer>:<dims>'")
    parsed = []
    for part in parts:
        m = _PART.match(part)
        if not m:
            raise AllocationError(f"{part!r}: expected '<backend>:<dims>'")
        parsed.append((m.group(1), m.group(2), part))

    rollout_backend = rollout = None
    if len(parsed) == 2:
        rollout_backend, dims, part = parsed[0]
        if rollout_backend not in ROLLOUT_BACKENDS:
            raise AllocationError(
                f"{part!r}: unknown rollout backend {rollout_backend!r}; "
                f"expected one of {ROLLOUT_BACKENDS}"
            )
        rollout = _parse_dims(part, dims, _ROLLOUT_LETTERS)
    trainer_backend, dims, part = parsed[-1]
    if trainer_backend not in TRAINER_BACKENDS:
        where = "second" if len(parsed) == 2 else "only"
        raise AllocationError(
            f"{part!r}: the {where} part must be the trainer "
            f"({'/'.join(TRAINER_BACKENDS)}), got {trainer_backend!r}"
        )
    hybrid = _HYBRID.match(dims)
    if hybrid:
        return Allocation(
            rollout_backend, rollout, trainer_backend, _parse_hybrid(part, hybrid.group(1))
        )
    trainer = _parse_dims(part, dims, _TRAINER_LETTERS)
    if (trainer.dp * trainer.cp) % trainer.ep != 0:
        raise AllocationError(
            f"{part!r}: 'e' (expert parallel size {trainer.ep}) must divide "
            f"d·c = {trainer.dp}·{trainer.cp} = {trainer.dp * trainer.cp}"
        )
    return Allocation(rollout_backend, rollout, trainer_backend, trainer)

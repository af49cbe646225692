"""Packed (varlen) attention for megatron's local layer spec: no work across sequences.

megatron-core's own ``DotProductAttention`` (the local spec, used on CPU and on GPU without
TransformerEngine) refuses ``PackedSeqParams`` and needs a dense ``[T, T]`` block-diagonal
mask for a packed micro-batch: time and memory quadratic in the packed length, most of it
spent on pairs of tokens from different sequences that the mask then throws away.

:class:`VarlenDotProductAttention` is a drop-in ``core_attention`` for that spec. Given THD
``PackedSeqParams`` (the same ones TransformerEngine gets) it runs
``torch.nn.functional.scaled_dot_product_attention`` (causal, grouped-query) on each packed
slot alone, so the cost is that of running each sequence alone: slots of similar length as
one padded batch, cut by width where another call costs less than the padding
(:func:`split_batches`), a long slot as a causal call of its own. Slot bounds are the padded
offsets when present (the padding of a slot attends inside its slot and is ignored by the loss).
Without packed parameters it keeps megatron's behaviour: a given mask goes through the parent
class (the dense reference path), no mask means plain causal attention over the whole
sequence, done by SDPA.

Sliding-window attention (``config.window_size = (W - 1, 0)``, Mistral) is applied on every
path: a slot (or sequence) longer than ``W`` gets an explicit causal-window mask (see
:mod:`areal_mega.models.sliding_window`), a given mask is narrowed by the window. megatron's
own torch softmax would instead *replace* a given mask by a window mask over the whole
packed row (letting sequences see each other), so the window is taken out of it here.

Attention-logit soft-capping (``softcap``: scores become ``c · tanh(scores / c)`` before the
mask and softmax, Gemma 2) and attention sinks (``sink``: one learnt logit per head that joins
each row's softmax without a value, GPT-OSS; megatron-core's ``softmax_offset``) have no SDPA
kernel: with either every path computes the scores explicitly (:func:`attention`), the
given-mask path included.

What a layer derives from the host layout alone (the batches' index rows, masks and order) is
a plan (:class:`UnitPlan`; slots are units without a shared context) made once per
micro-batch and kept on its packed parameters (:func:`micro_batch_plan`): every layer of the
forward, and a recomputed forward, reuse it.

bf16 attention of short queries on a CPU runs in fp32 (:data:`CPU_FP32_ATTENTION_MAX_QUERY`):
torch's bf16 CPU kernel is several times slower there than the fp32 one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from areal_mega.common.cpu_bf16 import bf16_in_fp32
from areal_mega.models.sliding_window import window_visible

__all__ = [
    "VarlenDotProductAttention",
    "attention",
    "SharedPrefixSeqParams",
    "packed_slot_bounds",
    "varlen_causal_attention",
    "unit_attention",
    "batch_entries",
    "split_batches",
    "micro_batch_plan",
    "plan_unit_attention",
    "plan_varlen_attention",
    "UnitPlan",
    "slot_units",
]


@dataclass
class SharedPrefixSeqParams(PackedSeqParams):
    """THD ``PackedSeqParams`` of a micro-batch whose shared prompt prefixes are computed once:
    ``units`` (host tuples, see :mod:`areal_mega.scheduler.shared_prefix`) say which rows each
    row attends to; only :class:`VarlenDotProductAttention` reads them."""

    units: Optional[list] = None


def micro_batch_plan(packed_seq_params, key: tuple, make: Callable):
    """The attention plan ``make()`` of one micro-batch under ``key``, made once and kept on
    its ``packed_seq_params`` (made for one forward of the micro-batch): every layer, and
    the backward's recomputation, read the same host layout. Building it in each layer cost
    ~2 ms of host work there (index lists, masks, their copies into tensors)."""
    plans = packed_seq_params.__dict__.setdefault("_attention_plans", {})
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = make()
    return plan


def packed_slot_bounds(packed_seq_params) -> list[int]:
    """Host list of slot offsets ``[0, ..., T]`` of THD ``PackedSeqParams`` (the padded
    offsets when given, as TransformerEngine reads them)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    return [int(x) for x in cu.tolist()]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float,
    enable_gqa: bool = False,
    softcap: Optional[float] = None,
    sink: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``[b, h, Lq, d]`` tensors (``attn_mask``: True =
    attend), or with ``softcap`` / ``sink`` the same math computed explicitly (softmax in
    fp32): scores capped at ``softcap`` by tanh; ``sink`` ([h], one logit per head) joins
    every row's softmax as a key without a value (attention sinks, megatron-core's
    ``softmax_offset``), so a row's weights sum to less than one."""
    plain = softcap is None and sink is None
    if bf16_in_fp32(q, k, v) or (plain and _short_bf16_on_cpu(q)):
        # on fp32 copies, the output rounded once: a CPU without bf16 GEMMs, or short bf16
        # queries (see _short_bf16_on_cpu)
        return attention(
            q.float(),
            k.float(),
            v.float(),
            attn_mask=attn_mask,
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=enable_gqa,
            softcap=softcap,
            sink=sink,
        ).to(q.dtype)
    if plain:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    if enable_gqa:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        attn_mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if attn_mask is not None:
        # the lowest finite score, not -inf: a row with no visible key (padding past a window)
        # gets finite weights (its output is discarded) instead of NaN in the backward
        scores = scores.float().masked_fill(~attn_mask, torch.finfo(torch.float32).min)
    if sink is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:
        column = sink.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.float(), column], -1), dim=-1)[..., :-1]
        probs = probs.to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


# bf16 queries at most this long attend in fp32 on a CPU (see _short_bf16_on_cpu)
CPU_FP32_ATTENTION_MAX_QUERY = 160


def _short_bf16_on_cpu(q: torch.Tensor) -> bool:
    """Whether SDPA of bf16 ``q`` [b, h, Lq, d] runs on fp32 copies of q, k, v (the output
    rounded back to bf16): on a CPU, for short queries. torch's bf16 flash-attention kernel
    for the CPU is slow on short queries: up to CPU_FP32_ATTENTION_MAX_QUERY queries the
    forward+backward on fp32 copies, casts included, took 0.3-0.6x the bf16 kernel's CPU time
    (a GRPO micro-batch's padded units, 16 x 9 heads x 51 queries x 80 keys: 0.44x), about
    the same from 192 to 256 queries, and more beyond (2,048 causal: 1.5x); see
    bench/cpu_bf16.py. fp32 scores rounded once are no less accurate than the bf16 kernel's.
    On a CPU without bf16 GEMMs (:mod:`areal_mega.common.cpu_bf16`) :func:`attention` takes
    fp32 copies at every length: there the bf16 kernel's backward took 4x the fp32 one's
    (2-core AVX2 EPYC, 8 x 9 heads x 80 causal queries)."""
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and q.shape[-2] <= CPU_FP32_ATTENTION_MAX_QUERY
    )


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: Optional[list[int]],
    *,
    scale: float,
    dropout_p: float = 0.0,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sink: Optional[torch.Tensor] = None,
    plan: Optional["UnitPlan"] = None,
) -> torch.Tensor:
    """Causal attention of each slot ``[bounds[i], bounds[i+1])`` with itself.

    ``query`` [T, nq, d], ``key`` / ``value`` [T, nkv, d] with ``nq`` a multiple of ``nkv``
    (grouped-query attention). Returns [T, nq, d]. Tokens past ``bounds[-1]`` (if any) form
    one more slot. ``window``: each query sees only the ``window`` most recent keys of its
    slot (itself included); None: all earlier keys. ``softcap``, ``sink``: see
    :func:`attention`. ``plan``: :func:`plan_varlen_attention` of ``bounds`` (then unused),
    ``window`` and the row count, when the caller keeps it; made here otherwise.

    The slots are units without a context (:func:`unit_attention`): slots of similar length
    run as one padded batch (:func:`split_batches`: a GRPO micro-batch's dozens of samples in
    a few calls), a slot alone as a plain causal call."""
    if plan is None:
        plan = plan_varlen_attention(bounds, query.shape[0], window, query.device)
    kw = dict(scale=scale, dropout_p=dropout_p, window=window, softcap=softcap, sink=sink)
    return unit_attention(query, key, value, None, plan=plan, **kw)


def slot_units(bounds: list[int], total: int) -> list:
    """The slots ``bounds`` over ``total`` rows (rows past ``bounds[-1]`` form one more) as
    units without a context (pure)."""
    if bounds[-1] < total:
        bounds = list(bounds) + [total]
    return [(s, e - s, s, 0) for s, e in zip(bounds[:-1], bounds[1:])]


def plan_varlen_attention(
    bounds: list[int], total: int, window: Optional[int], device
) -> "UnitPlan":
    """The plan of :func:`varlen_causal_attention` for slots ``bounds`` over ``total`` rows
    and ``window``, its tensors on ``device``."""
    return plan_unit_attention(slot_units(bounds, total), window, device)


def unit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    units: list,
    *,
    scale: float,
    dropout_p: float = 0.0,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sink: Optional[torch.Tensor] = None,
    plan: Optional[UnitPlan] = None,
) -> torch.Tensor:
    """Attention of a micro-batch with shared prompt prefixes
    (:mod:`areal_mega.scheduler.shared_prefix`): each unit ``(start, length, ctx_start,
    ctx_len)`` of consecutive rows attends to the keys ``[ctx_start, ctx_start + ctx_len)`` and
    causally to its own, at positions ``ctx_len + i`` (the window counts positions). Units
    cover ``[0, T)`` in order. Units without a context and those with one run as padded
    batches, cut by width where the padding would cost more than another call
    (:func:`split_batches`; a batch of one entry is a call of its own); units that share a
    context (a GRPO group's branches) may share one entry of a batch (:func:`batch_entries`).
    ``plan``: :func:`plan_unit_attention` of ``units`` and ``window`` on ``query``'s device,
    when the caller keeps it (every layer of a micro-batch shares one); made here
    otherwise."""
    if plan is None:
        plan = plan_unit_attention(units, window, query.device)
    if not plan.groups:  # no rows
        return value.new_zeros((0, query.shape[1], value.shape[-1]))
    gqa = query.shape[1] != key.shape[1]
    kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=gqa, softcap=softcap, sink=sink)
    # index_select, not advanced indexing: its backward adds with index_add_, not index_put_
    # (on a CPU 4x faster in bf16 and 2x in fp32 at a GRPO micro-batch's shapes, and in bf16
    # closer to an fp64 sum: largest error 0.03 against 0.11)
    qs = torch.split(query.index_select(0, plan.q_index), plan.q_sizes)
    ks, vs = (torch.split(x.index_select(0, plan.k_index), plan.k_sizes) for x in (key, value))
    parts = [group.run(*qkv, **kw) for group, *qkv in zip(plan.groups, qs, ks, vs)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if plan.inverse is None else out.index_select(0, plan.inverse)


# what one entry of a padded SDPA batch, and one SDPA call of its own, cost besides their query
# x key area, in units of that area (fp32 forward+backward on a CPU, 9 query / 3 KV heads of
# 64: 32 entries of 2-32 queries against 4 of 8x as many, 72 calls against one batch;
# bench/cpu_step_ab.py --change unit_families)
ENTRY_AREA = 800
CALL_AREA = 2500


def _entry_widths(entries: list) -> tuple[list, list]:
    """Queries and keys of each entry (a list of units sharing a context)."""
    lens = [sum(u[1] for u in e) for e in entries]
    return lens, [e[0][3] + n for e, n in zip(entries, lens)]


def split_batches(entries: list) -> list[list]:
    """The padded SDPA batches of ``entries`` (lists of units sharing a context), pure:
    sorted by key span, then query width, and cut where padding the narrower to the wider
    would cost more than another call. Minimises the padded area plus :data:`ENTRY_AREA` per
    entry and :data:`CALL_AREA` per batch (exactly, over cuts between distinct widths).
    Answers of uneven length (1 to 128 tokens) padded to the longest cost 3-4x their causal
    area in one batch, 1.5-2x in a few batches by width."""
    return _width_batches(entries)[1]


def _width_batches(entries: list) -> tuple[int, list[list]]:
    """(cost, batches) of :func:`split_batches`."""
    lens, spans = _entry_widths(entries)
    runs: dict = {}  # entries of equal widths never gain from a cut between them
    for i in sorted(range(len(entries)), key=lambda i: (spans[i], lens[i])):
        runs.setdefault((spans[i], lens[i]), []).append(entries[i])
    runs = list(runs.items())
    best, cut = [0] + [None] * len(runs), [0] * (len(runs) + 1)
    for j in range(1, len(runs) + 1):
        count = width_q = width_k = 0
        for i in range(j - 1, -1, -1):
            (span, n), members = runs[i]
            count, width_q, width_k = count + len(members), max(width_q, n), max(width_k, span)
            cost = best[i] + count * (width_q * width_k + ENTRY_AREA) + CALL_AREA
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    batches, j = [], len(runs)
    while j:
        batches.append([e for _, members in runs[cut[j] : j] for e in members])
        j = cut[j]
    return best[-1], batches[::-1]


def batch_entries(units: list) -> list[list]:
    """The entries of the padded attention batches of ``units`` (pure): one per unit, or,
    when that costs less, one per context ``(ctx_start, ctx_len)``: the units attending to the
    same keys (a GRPO group's answers to its prompt) concatenated into one entry, each unit
    masked from the others. Many short answers then make a few long entries instead of many
    short ones, which torch's CPU attention kernel runs at a small fraction of its speed; long
    or uneven answers stay one per entry (the masked pairs between them would cost more).
    Costs: those of the entries' :func:`split_batches`."""
    families: dict = {}
    for u in units:
        families.setdefault((u[2], u[3]), []).append(u)
    singles = [[u] for u in units]
    if not units[0][3] or len(families) == len(units):
        return singles
    grouped = list(families.values())
    return grouped if _width_batches(grouped)[0] < _width_batches(singles)[0] else singles


@dataclass
class _UnitBatch:
    """One padded SDPA batch of entries: each entry's query and key rows (``q_rows``
    [E, Q], ``k_rows`` [E, K]; padding repeats the entry's first row), the mask
    [E, 1, Q, K] and the flat positions of the real queries in the output (``keep``). A lone
    unit without a context, inside its window, has neither: a plain causal call."""

    q_rows: torch.Tensor
    k_rows: torch.Tensor
    mask: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]

    def run(self, q, k, v, **kw) -> torch.Tensor:
        """Attention of the batch's gathered rows: ``q`` [E·Q, h, d] (the rows ``q_rows``
        name, in order), ``k`` / ``v`` [E·K, h_kv, d]; returns the real queries' outputs."""
        q = q.view(*self.q_rows.shape, *q.shape[1:]).transpose(1, 2)  # [E, h, Q, d]
        k, v = (x.view(*self.k_rows.shape, *x.shape[1:]).transpose(1, 2) for x in (k, v))
        if self.mask is None:  # a lone slot: causal, the kernel skips the hidden blocks
            o = attention(q, k, v, is_causal=True, **kw)
        else:
            o = attention(q, k, v, attn_mask=self.mask, **kw)
        o = o.transpose(1, 2)  # [E, Q, h, d]
        o = o.reshape(-1, *o.shape[2:])
        return o if self.keep is None else o.index_select(0, self.keep)


@dataclass
class UnitPlan:
    """What :func:`unit_attention` derives from the host units alone (the same for every
    layer of a micro-batch): the padded batches it runs (:class:`_UnitBatch`), in order, the
    rows of all their queries and keys (``q_index``, ``k_index``: gathered once, so the
    backward adds into one gradient per input, not one per batch) and the permutation back to
    the rows' order (None: already in order)."""

    groups: list
    inverse: Optional[torch.Tensor]
    q_index: torch.Tensor
    k_index: torch.Tensor
    q_sizes: list
    k_sizes: list


def plan_unit_attention(units: list, window: Optional[int], device) -> UnitPlan:
    """The :class:`UnitPlan` of :func:`unit_attention` for ``units`` and ``window``, its
    index and mask tensors on ``device``."""
    units = [u for u in units if u[1] > 0]
    groups, order = [], []
    for group in ([u for u in units if u[3] == 0], [u for u in units if u[3] > 0]):
        if group:
            for batch in split_batches(batch_entries(group)):
                groups.append(_plan_entries(batch, window, device))
                order += [u[0] + i for entry in batch for u in entry for i in range(u[1])]
    inverse = None
    if order != list(range(len(order))):
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        inverse = inverse.to(device)
    none = torch.zeros(0, dtype=torch.long, device=device)
    return UnitPlan(
        groups,
        inverse,
        q_index=torch.cat([none] + [g.q_rows.reshape(-1) for g in groups]),
        k_index=torch.cat([none] + [g.k_rows.reshape(-1) for g in groups]),
        q_sizes=[g.q_rows.numel() for g in groups],
        k_sizes=[g.k_rows.numel() for g in groups],
    )


def _plan_entries(entries: list, window: Optional[int], device) -> "_UnitBatch":
    """The :class:`_UnitBatch` that computes the units of ``entries`` (their outputs [sum of
    lengths, h, d], in their order)."""
    units = [u for e in entries for u in e]
    lens, spans = _entry_widths(entries)
    q_idx = torch.tensor([u[0] + i for u in units for i in range(u[1])], device=device)
    k_idx = torch.tensor(
        [
            j
            for e in entries
            for j in (
                *range(e[0][2], e[0][2] + e[0][3]),
                *(r for u in e for r in range(u[0], u[0] + u[1])),
            )
        ],
        device=device,
    )
    if len(units) == 1 and not units[0][3] and (window is None or units[0][1] <= window):
        return _UnitBatch(q_idx[None], k_idx[None], None, None)
    width_q, width_k = max(lens), max(spans)
    # per entry: the unit of each query and key (context keys: -1, padding: -2), its position
    # and its row in q_idx / k_idx (padding: the entry's first); a unit's queries see the
    # context and, causally, their own unit's keys
    q_unit, q_pos, q_rows, k_unit, k_pos, k_rows = [], [], [], [], [], []
    q_off = k_off = 0
    for e, n, span in zip(entries, lens, spans):
        ctx = e[0][3]
        own = [(m, ctx + i) for m, u in enumerate(e) for i in range(u[1])]
        q_unit.append([m for m, _ in own] + [-2] * (width_q - n))
        q_pos.append([p for _, p in own] + [0] * (width_q - n))
        k_unit.append([-1] * ctx + q_unit[-1][:n] + [-2] * (width_k - span))
        k_pos.append([*range(ctx), *q_pos[-1][:n]] + [0] * (width_k - span))
        q_rows.append([*range(q_off, q_off + n)] + [q_off] * (width_q - n))
        k_rows.append([*range(k_off, k_off + span)] + [k_off] * (width_k - span))
        q_off, k_off = q_off + n, k_off + span
    q_unit, q_pos, k_unit, k_pos = map(torch.tensor, (q_unit, q_pos, k_unit, k_pos))
    d = q_pos[:, :, None] - k_pos[:, None, :]  # [E, Q, K]
    ku = k_unit[:, None, :]
    mask = ((ku == -1) | (ku == q_unit[:, :, None])) & (d >= 0)
    if window is not None:
        mask &= d < window
    # a padded query sees every real key (finite weights; its output is discarded)
    mask = torch.where(q_unit[:, :, None] == -2, ku != -2, mask)
    q_rows, k_rows = (torch.tensor(r, device=device) for r in (q_rows, k_rows))
    keep = (q_unit.reshape(-1) != -2).nonzero().squeeze(1).to(device)
    # rows of query / key: one gather each
    return _UnitBatch(q_idx[q_rows], k_idx[k_rows], mask[:, None].to(device), keep)


def _causal_sdpa(q, k, v, window: Optional[int], **kw) -> torch.Tensor:
    """SDPA of ``[b, h, L, d]`` tensors, causal, within ``window`` (None: unlimited); the
    explicit mask is built only when the sequence is longer than the window."""
    L = q.shape[2]
    if window is None or L <= window:
        return attention(q, k, v, is_causal=True, **kw)
    pos = torch.arange(L, device=q.device)
    return attention(q, k, v, attn_mask=window_visible(pos, pos, window), **kw)


class VarlenDotProductAttention(DotProductAttention):
    """megatron ``DotProductAttention`` that accepts THD ``PackedSeqParams`` (see module
    docstring). Causal sliding windows (``window_size = (W - 1, 0)``), soft-capping and
    softmax offsets (``softmax_type`` ``learnable``: GPT-OSS's attention sinks, or
    ``off-by-one``) are honoured on every path."""

    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        # MLA passes its query/key and value head dims (TE's attention takes them); megatron's
        # local DotProductAttention does not: its output width comes from config.kv_channels,
        # which the builder sets to the value head dim for MLA (areal_mega.models.builder)
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(
                f"value head dim {v_channels} != config.kv_channels {config.kv_channels}"
            )
        super().__init__(config, *args, **kwargs)
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            # one logit per head of this rank's heads: a tensor-parallel slice (dim 0), so the
            # weight export gathers it and the gradient norm counts every rank's slice
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        self.window: Optional[int] = None
        window_size = self.scale_mask_softmax.window_size
        if window_size is not None:
            left, right = (int(x) for x in window_size)
            if right != 0 or left < 0:
                raise ValueError(
                    f"window_size={tuple(window_size)}: the packed local attention "
                    "supports causal windows (W - 1, 0) only"
                )
            self.window = left + 1
            self.scale_mask_softmax.window_size = None  # applied here (see module docstring)
        # apply_query_key_layer_scaling divides the scale by the layer number and the
        # softmax multiplies it back: the product is the plain 1/sqrt(d) scale.
        coeff = self.scale_mask_softmax.scale or 1.0
        self.sdpa_scale = self.softmax_scale * coeff
        self.softcap: Optional[float] = None  # attention-logit soft-capping (Gemma 2)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """THD ``query`` [T, nq, d] (``key`` / ``value`` [T, nkv, d]) with packed params ->
        [T, nq·d]; sbhd without packed params -> [s, b, nq·d] like the parent class."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by DotProductAttention")
        p = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(
                    f"packed attention needs qkv_format='thd', got {packed_seq_params.qkv_format!r}"
                )
            kw = dict(
                scale=self.sdpa_scale,
                dropout_p=p,
                window=self.window,
                softcap=self.softcap,
                sink=self.softmax_offset,
            )
            units = getattr(packed_seq_params, "units", None)
            if units is not None:
                plan = micro_batch_plan(
                    packed_seq_params,
                    ("units", self.window, query.device),
                    lambda: plan_unit_attention(units, self.window, query.device),
                )
                out = unit_attention(query, key, value, units, plan=plan, **kw)
            else:
                plan = micro_batch_plan(
                    packed_seq_params,
                    ("slots", self.window, query.device, query.shape[0]),
                    lambda: plan_varlen_attention(
                        packed_slot_bounds(packed_seq_params),
                        query.shape[0],
                        self.window,
                        query.device,
                    ),
                )
                out = varlen_causal_attention(query, key, value, None, plan=plan, **kw)
            # heads x value dim; MLA pads its values to the query dim here and trims after
            return out.reshape(out.shape[0], -1)
        if attention_mask is not None:
            if self.window is not None:  # megatron's mask: True = masked
                sq, sk = query.shape[0], key.shape[0]
                outside = ~window_visible(
                    torch.arange(sk - sq, sk, device=query.device),
                    torch.arange(sk, device=query.device),
                    self.window,
                )
                attention_mask = attention_mask | outside
            if self.softcap is not None or self.softmax_offset is not None:
                # megatron's softmax has no cap: the explicit path (sinks too: one implementation)
                return self._masked_explicit(query, key, value, attention_mask, p)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        o = _causal_sdpa(
            q,
            k,
            v,
            self.window,
            dropout_p=p,
            scale=self.sdpa_scale,
            enable_gqa=q.shape[1] != k.shape[1],
            softcap=self.softcap,
            sink=self.softmax_offset,
        )
        s, b = query.shape[0], query.shape[1]
        return o.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _masked_explicit(self, query, key, value, attention_mask, dropout_p):
        """sbhd ``query`` / ``key`` / ``value`` under megatron's mask ([b or 1, 1, sq, sk],
        True = masked), scores soft-capped and / or with sinks: [s, b, nq·d]."""
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        o = attention(
            q,
            k,
            v,
            attn_mask=~attention_mask,
            dropout_p=dropout_p,
            scale=self.sdpa_scale,
            enable_gqa=q.shape[1] != k.shape[1],
            softcap=self.softcap,
            sink=self.softmax_offset,
        )
        s, b = query.shape[0], query.shape[1]
        return o.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

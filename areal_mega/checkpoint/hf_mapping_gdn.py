"""HF <-> megatron layouts of Qwen3-Next's tensors that are row permutations (and one offset).

* ``gated_qkv`` (the bridge's ``QKVMapping`` with ``attention_output_gate``): HF's ``q_proj``
  holds per head ``[q_h; gate_h]`` (``2 * head_dim`` rows); megatron's ``linear_qkv`` holds per
  KV group ``[q heads; gate heads; k; v]``;
* ``gdn_in_proj`` (``GDNLinearMapping``): HF's ``in_proj_qkvz`` holds per key head
  ``[q; k; v group; z group]`` and ``in_proj_ba`` per key head ``[b group; a group]`` (a group:
  the value heads of that key head); megatron's ``in_proj`` holds ``[q; k; v; z; b; a]``, each
  over all heads in head order;
* ``gdn_in_proj_split`` (``GDNLinearMappingSeparate``, Qwen3.5): HF's ``in_proj_qkv``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, each over all heads in head order: megatron's
  ``in_proj`` is their concatenation;
* ``minus_one`` (``RMSNorm2ZeroCenteredRMSNormMapping``): the gated delta-net's output norm,
  a plain gain ``w`` in HF, ``w - 1`` in megatron's zero-centred norm.

A permutation is described by :func:`row_blocks`: per HF tensor, the megatron row ranges whose
concatenation is that HF tensor. Under tensor parallelism megatron splits ``in_proj`` (and the
convolution over ``[q; k; v]``) section by section (:func:`tp_sections`).
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "GDN_KINDS",
    "ROW_PERMUTATION_KINDS",
    "row_blocks",
    "full_rows",
    "to_mcore",
    "to_hf",
    "to_hf_segments",
    "to_mcore_segments",
    "tp_sections",
]

#: kinds whose HF tensors are row blocks of the megatron tensor
ROW_PERMUTATION_KINDS = ("gated_qkv", "gdn_in_proj", "gdn_in_proj_split")
#: every kind of this module
GDN_KINDS = ROW_PERMUTATION_KINDS + ("minus_one",)

Blocks = List[List[Tuple[int, int]]]


def _gated_qkv_blocks(arch) -> Blocks:
    nh, ng, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
    r = nh // ng
    group = (2 * r + 2) * hd
    q: List[Tuple[int, int]] = []
    for h in range(nh):
        g, j = divmod(h, r)
        q.append((g * group + j * hd, g * group + (j + 1) * hd))  # q_h
        q.append((g * group + (r + j) * hd, g * group + (r + j + 1) * hd))  # gate_h
    k = [(g * group + 2 * r * hd, g * group + (2 * r + 1) * hd) for g in range(ng)]
    v = [(g * group + (2 * r + 1) * hd, (g + 1) * group) for g in range(ng)]
    return [q, k, v]


def _gdn_in_proj_blocks(arch) -> Blocks:
    nk, nv, dk, dv = arch.gdn_heads
    r = nv // nk
    sizes = (nk * dk, nk * dk, nv * dv, nv * dv, nv, nv)  # q k v z b a
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    per_key_head = (dk, dk, r * dv, r * dv, r, r)
    qkvz, ba = [], []
    for g in range(nk):
        for i, w in enumerate(per_key_head):
            (qkvz if i < 4 else ba).append((starts[i] + g * w, starts[i] + (g + 1) * w))
    return [qkvz, ba]


def _gdn_in_proj_split_blocks(arch) -> Blocks:
    nk, nv, dk, dv = arch.gdn_heads
    qkv, z, b = 2 * nk * dk + nv * dv, nv * dv, nv
    ends = (qkv, qkv + z, qkv + z + b, qkv + z + 2 * b)
    return [[(0 if i == 0 else ends[i - 1], e)] for i, e in enumerate(ends)]


def row_blocks(arch, kind: str) -> Blocks:
    """Per HF tensor (in the table's order), the megatron row ranges ``[a, b)`` whose
    concatenation is that HF tensor."""
    if kind == "gated_qkv":
        return _gated_qkv_blocks(arch)
    if kind == "gdn_in_proj":
        return _gdn_in_proj_blocks(arch)
    if kind == "gdn_in_proj_split":
        return _gdn_in_proj_split_blocks(arch)
    raise ValueError(kind)


def full_rows(arch, kind: str) -> int:
    """Rows of the full megatron tensor of ``kind``."""
    return sum(b - a for blocks in row_blocks(arch, kind) for a, b in blocks)


def to_hf_segments(arch, kind: str, t: torch.Tensor) -> Tuple[List[torch.Tensor], ...]:
    """Each HF tensor as a list of row-block views of the megatron tensor ``t``."""
    if kind == "minus_one":
        return ([t + 1],)
    return tuple([t[a:b] for a, b in blocks] for blocks in row_blocks(arch, kind))


def to_hf(arch, kind: str, t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The full megatron tensor -> HF tensors (in the table's order)."""
    return tuple(torch.cat(segs) for segs in to_hf_segments(arch, kind, t))


def to_mcore_segments(
    arch, kind: str, hf_names: Sequence[str], get: Callable[[str], torch.Tensor]
) -> Iterator[torch.Tensor]:
    """The megatron tensor as row blocks in its order, read from the HF tensors through
    ``get``."""
    if kind == "minus_one":
        yield get(hf_names[0]) - 1
        return
    pieces = []  # (megatron start, HF tensor index, HF start, rows)
    for i, blocks in enumerate(row_blocks(arch, kind)):
        at = 0
        for a, b in blocks:
            pieces.append((a, i, at, b - a))
            at += b - a
    tensors: dict = {}
    for _, i, at, n in sorted(pieces):
        if i not in tensors:
            tensors[i] = get(hf_names[i])
        yield tensors[i][at : at + n]


def to_mcore(arch, kind: str, hf_tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """HF tensors (in the table's order) -> the full megatron tensor."""
    names = [str(i) for i in range(len(hf_tensors))]
    return torch.cat(list(to_mcore_segments(arch, kind, names, lambda n: hf_tensors[int(n)])))


def tp_sections(arch, suffix: str) -> Optional[Tuple[int, ...]]:
    """The full sizes of the sections megatron splits separately across tensor-parallel ranks
    (each rank holds its share of every section, in order), for the gated delta-net's input
    projection and convolution; None for other tensors."""
    if arch.gdn_heads is None:
        return None
    nk, nv, dk, dv = arch.gdn_heads
    if suffix == "self_attention.in_proj.weight":
        return (nk * dk, nk * dk, nv * dv, nv * dv, nv, nv)
    if suffix == "self_attention.conv1d.weight":
        return (nk * dk, nk * dk, nv * dv)
    return None

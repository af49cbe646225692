"""``PackedBatch``: the typed RL micro-batch the trainer plans, the engine runs and the loss reads.

A :class:`PackedBatch` is an immutable dataclass with one declared field per tensor (no other
keys), built once per micro-batch by :meth:`PackedBatch.from_packed` from
:func:`areal_mega.scheduler.packing.pack_sequences` output. It is also a read-only
``Mapping`` over its non-None fields, so the engine (``mb["input_ids"]``, ``mb.get(...)``) and
the loss functions (``loss_fn(logprobs, entropy, mb)``, via the engine's ``loss_view``) read it
exactly as they read the plain packed dicts of SFT and the tests.

Field vocabulary — one from the trajectory to the loss, nothing is renamed on the way:

* a per-token field has the :class:`~areal_mega.dataplane.trajectory.Trajectory`'s name
  (``input_ids``, ``loss_mask``, ``logprobs``, ``versions``): ``logprobs`` are the behaviour
  (rollout) policy's logprobs as on the wire, read by the loss as ``mb["logprobs"]`` (the
  loss's positional ``logprobs`` argument is π_θ's, a different tensor that is never stored);
* a per-sequence field is the trajectory attribute's column, named in the plural
  (``reward`` → ``rewards``, ``sample_id`` → ``sample_ids``, ``group_id`` → ``group_ids``,
  ``prompt_len`` → ``prompt_lens``), as ``pack_sequences`` packs it;
* a derived field has its own name because it is a different thing: ``group_index`` (the
  integer index of ``group_ids``, in order of first appearance, for tensor group statistics;
  not the id), ``seq_no_eos``, ``response_lens``, ``advantages`` and the attached fields.

Fields (T packed tokens, B sequences; per-token fields in next-token layout — position t holds
the data of token t+1, matching the engine's logprob of token t+1 at position t):

* layout: ``input_ids`` / ``position_ids`` / ``segment_ids`` [T], ``cu_seqlens`` /
  ``cu_seqlens_padded`` int32 [B+1], ``max_seqlen`` / ``max_seqlen_padded``;
* per token [T]: ``labels`` (int64, the next token of the same sequence — the engine's
  targets —, -1 after each sequence's last token and on padding, see
  :data:`~areal_mega.scheduler.packing.PER_TOKEN_FILL`), ``loss_mask``, ``logprobs``
  (behaviour), ``versions``, ``advantages``; attached after planning: ``prox_logprobs``,
  ``ref_logprobs``, ``teacher_logprobs`` (OPD, with the OPD ``advantages`` replacing the
  planned ones); with a critic ``values``, ``returns`` and the GAE ``advantages``
  (replacing the planned zeros);
* per sequence [B]: ``rewards``, ``seqlens``, ``prompt_lens``, ``response_lens``,
  ``min_versions``, ``finish_codes``, ``seq_no_eos``, ``group_index`` (derived from
  ``group_ids``); ``sample_ids`` / ``group_ids`` (lists of str);
* ``policy_version``: the weight version that computed ``prox_logprobs`` (attached);
* images (vision-language models), in packed order, the engine's model input:
  ``pixel_values`` [patches, patch_dim] and ``image_grid_thw`` [images, 3] of every sequence's
  images one sequence after the other, ``image_counts`` [B] how many each sequence has (the
  trajectory's ``multimodal``; all None without images); ``image_data`` [B] (list of lists
  of str, None when no sequence has any): each sequence's images as its prompt sent them to
  the rollout servers (the trajectory's ``meta["image_data"]``), what a served teacher
  scores it with;
* ``routed_experts`` [T, MoE layers, topk] (with routing replay): the expert ids the rollout
  routed each token to when it was a model *input* — so in the input layout of ``input_ids``,
  not shifted — and -1 where none (each sequence's last token, padding).

Fields computed after planning are attached with :meth:`PackedBatch.with_fields`, which returns
a new batch (the planned one is never mutated) and checks every per-token tensor has length T.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

__all__ = ["PackedBatch", "TOKEN_FIELDS", "ATTACHABLE_FIELDS", "check_images"]

#: Per-token [T] fields (next-token layout).
TOKEN_FIELDS = (
    "input_ids",
    "position_ids",
    "segment_ids",
    "labels",
    "loss_mask",
    "logprobs",
    "versions",
    "advantages",
    "prox_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "values",
    "returns",
)
#: Fields that may be attached to a planned batch with :meth:`PackedBatch.with_fields`.
ATTACHABLE_FIELDS = (
    "prox_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "policy_version",
    "values",
    "returns",
    "advantages",
)


def check_images(pixel_values, image_grid_thw, image_counts, n_seqs: int) -> None:
    """A packed batch's images are consistent: all three set, ``image_counts`` [B] summing to
    the grid's rows, ``pixel_values`` rows = ``sum(t·h·w)`` (ValueError naming the field)."""
    if pixel_values is None or image_grid_thw is None or image_counts is None:
        raise ValueError(
            "PackedBatch: 'pixel_values', 'image_grid_thw' and 'image_counts' go together"
        )
    if tuple(image_counts.shape) != (n_seqs,) or int(image_counts.sum()) != len(image_grid_thw):
        raise ValueError(
            f"PackedBatch: 'image_counts' {image_counts.tolist()} does not give the "
            f"{len(image_grid_thw)} images of 'image_grid_thw' to B={n_seqs} sequences"
        )
    if pixel_values.dim() != 2 or int(image_grid_thw.prod(-1).sum()) != len(pixel_values):
        raise ValueError(
            f"PackedBatch: 'pixel_values' of shape {tuple(pixel_values.shape)} do not hold the "
            "sum(t*h*w) patches of 'image_grid_thw'"
        )


@dataclass(frozen=True, eq=False)
class PackedBatch(Mapping):
    """One packed RL micro-batch (see the module docstring for every field)."""

    input_ids: Tensor
    position_ids: Tensor
    segment_ids: Tensor
    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    max_seqlen: int
    max_seqlen_padded: int
    labels: Tensor
    loss_mask: Tensor
    logprobs: Tensor
    versions: Tensor
    advantages: Tensor
    rewards: Tensor
    seqlens: Tensor
    prompt_lens: Tensor
    response_lens: Tensor
    min_versions: Tensor
    finish_codes: Tensor
    seq_no_eos: Tensor
    group_index: Tensor
    sample_ids: list
    group_ids: list
    prox_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    teacher_logprobs: Optional[Tensor] = None  # on-policy distillation's teacher (OPD)
    policy_version: Optional[int] = None
    values: Optional[Tensor] = None  # the critic's, with a critic (GAE)
    returns: Optional[Tensor] = None  # GAE returns, the value loss's targets
    routed_experts: Optional[Tensor] = None  # rollout MoE routes [T, layers, topk] (R3)
    pixel_values: Optional[Tensor] = None  # images of the sequences in packed order
    image_grid_thw: Optional[Tensor] = None  # [images, 3]
    image_counts: Optional[Tensor] = None  # [B] images per sequence
    image_data: Optional[list] = None  # [B] the images as sent to the servers (str lists)

    def __post_init__(self):
        t = int(self.input_ids.shape[0])
        b = int(self.cu_seqlens.shape[0]) - 1
        for name in TOKEN_FIELDS:
            v = getattr(self, name)
            if v is not None and tuple(v.shape) != (t,):
                raise ValueError(
                    f"PackedBatch: per-token field {name!r} has shape "
                    f"{tuple(v.shape)}, expected ({t},) like input_ids"
                )
        r = self.routed_experts
        if r is not None and (r.dim() != 3 or int(r.shape[0]) != t):
            raise ValueError(
                f"PackedBatch: 'routed_experts' has shape {tuple(r.shape)}, "
                f"expected ({t}, layers, topk) like input_ids"
            )
        for name in (
            "rewards",
            "seqlens",
            "prompt_lens",
            "response_lens",
            "min_versions",
            "finish_codes",
            "seq_no_eos",
            "group_index",
            "sample_ids",
            "group_ids",
            "image_data",
        ):
            if name == "image_data" and self.image_data is None:
                continue
            if len(getattr(self, name)) != b:
                raise ValueError(
                    f"PackedBatch: per-sequence field {name!r} has "
                    f"{len(getattr(self, name))} entries, expected B={b}"
                )
        images = (self.pixel_values, self.image_grid_thw, self.image_counts)
        if any(x is not None for x in images):
            check_images(*images, b)
        if tuple(self.cu_seqlens_padded.shape) != (b + 1,):
            raise ValueError("PackedBatch: cu_seqlens_padded must have B+1 entries like cu_seqlens")

    @classmethod
    def from_packed(cls, packed: dict) -> "PackedBatch":
        """The typed batch of a ``pack_sequences`` result whose samples carry ``labels``,
        ``loss_mask``, ``logprobs`` (behaviour), ``versions`` and ``advantages``; derives
        ``group_index``, ``seq_no_eos`` and ``response_lens`` as
        :func:`~areal_mega.algo.packing.with_algo_fields` does. Fields of ``packed`` not
        declared here, or required ones missing from it, raise a ValueError naming them."""
        from areal_mega.algo.packing import with_algo_fields

        full = with_algo_fields(packed)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(full) - names - {"token_keys"}
        if unknown:
            raise ValueError(f"PackedBatch: undeclared packed fields {sorted(unknown)}")
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in full and f.default is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(
                f"PackedBatch: packed batch lacks the fields {missing} (labels "
                "come from train.batches.next_token_layout)"
            )
        return cls(**{k: v for k, v in full.items() if k in names})

    def with_fields(self, **fields: Any) -> "PackedBatch":
        """A new batch with the attachable fields (:data:`ATTACHABLE_FIELDS`) set; tensors are
        converted with ``torch.as_tensor`` and shape-checked. ``self`` is left unchanged."""
        bad = set(fields) - set(ATTACHABLE_FIELDS)
        if bad:
            raise ValueError(
                f"PackedBatch.with_fields: {sorted(bad)} cannot be attached "
                f"(attachable: {list(ATTACHABLE_FIELDS)})"
            )
        conv = {
            k: (v if k == "policy_version" or isinstance(v, Tensor) else torch.as_tensor(v))
            for k, v in fields.items()
        }
        return dataclasses.replace(self, **conv)

    @property
    def n_tokens(self) -> int:
        """T: packed tokens, padding included."""
        return int(self.input_ids.shape[0])

    @property
    def n_seqs(self) -> int:
        """B: sequences in the batch."""
        return int(self.cu_seqlens.shape[0]) - 1

    # read-only Mapping over the fields that are set (the engine and loss read by key)
    def __getitem__(self, key: str):
        if key not in self._set_names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._set_names())

    def __len__(self) -> int:
        return len(self._set_names())

    def _set_names(self) -> tuple:
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)

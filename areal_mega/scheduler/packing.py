"""Pack variable-length trajectories into one flat ("thd") batch for the engine.

Layout of a packed batch of B sequences with real lengths ``L_0 .. L_{B-1}``::

    | seq 0 (L_0) [cp pad] | seq 1 (L_1) [cp pad] | ... | seq B-1 [cp pad] | trailing pad |
    ^ cu_seqlens_padded[0]  ^ cu_seqlens_padded[1]                          ^ cu_seqlens_padded[B]
                                                                             (start of padding)

* Slot ``b`` holds sequence ``b`` at ``[cu_seqlens_padded[b], cu_seqlens_padded[b] + L_b)``.
  With ``cp_size == 1`` slots have no padding of their own, so ``cu_seqlens_padded ==
  cu_seqlens``. With ``cp_size > 1`` every slot is padded to a multiple of ``2 * cp_size`` (so
  each sequence splits into ``2 * cp_size`` equal zigzag chunks, see :func:`zigzag_cp_shard`).
* ``cu_seqlens`` int32 [B+1] is the running sum of the *real* lengths (TransformerEngine's
  ``cu_seqlens_q``); ``cu_seqlens_padded`` int32 [B+1] the slot offsets
  (``cu_seqlens_q_padded``). Both exclude the trailing padding.
* **Trailing padding** ``[cu_seqlens_padded[B], T)`` brings T to a multiple of
  ``pad_to_multiple`` (use TP, or ``2 * TP * CP`` with context parallelism). It forms its own
  segment: ``segment_ids`` is ``B`` there, ``position_ids`` restart at 0, ``input_ids`` are
  ``pad_token_id``, ``loss_mask`` 0, ``logprobs`` 0, ``versions`` -1, ``labels`` -1, extras 0. An
  engine
  building a block-diagonal causal mask from ``segment_ids`` therefore needs no special case,
  and since no real token attends to a later token, padding never changes real outputs.
* Per-slot CP padding continues its sequence's positions (``L_b, L_b + 1, ...``) and has
  ``segment_ids == b``; its loss_mask is 0 and its labels -1.
* ``labels`` (the engine's next-token targets) are packed like any per-token field; they come
  from the samples (``train.batches.next_token_layout``), nothing here shifts tokens.
* Images (``Trajectory.multimodal``, or a dict sample's ``multimodal``) are not per-token:
  ``pixel_values`` [patches, patch_dim] and ``image_grid_thw`` [images, 3] hold the images of
  all sequences in packed order (what the vision-language engine reads), and ``image_counts``
  int32 [B] how many each sequence has; all three only when a sequence has images.
  ``image_data`` (list [B] of lists of str; only when a sequence has some): each sequence's
  images as its prompt sent them to the servers (a trajectory's ``meta["image_data"]``, a dict
  sample's ``image_data``), what a served teacher scores the sequence with.
* An empty list packs to a padding-only batch of ``max(pad_to_multiple, 2 * cp_size)``
  tokens (B = 0, ``labels`` all -1), so a rank with an empty micro-batch still runs a
  forward/backward pass with
  zero loss weight (the scheduler may hand out empty micro-batches to keep counts equal).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np
import torch

from areal_mega.dataplane.trajectory import FINISH_REASONS, Trajectory

PER_TOKEN_FILL = {
    "loss_mask": 0,
    "logprobs": 0.0,
    "versions": -1,
    "token_rewards": 0.0,
    "labels": -1,
    "routed_experts": -1,
}
"""Value of padding tokens per field (extras not listed here are padded with 0); ``labels``
(the next-token targets the engine scores) is -1 = no target; ``routed_experts`` (MoE routes
per token ``[layers, topk]``) -1 = no route."""

# dtypes of the standard per-token fields; an empty pack carries each of them (all padding)
_DEFAULT_DTYPES = {
    "loss_mask": np.uint8,
    "logprobs": np.float32,
    "versions": np.int32,
    "labels": np.int64,
}
_SCALAR_KEYS = {
    "sample_id",
    "group_id",
    "finish_reason",
    "server_id",
    "meta",
    "created_at",
    "prompt_len",
    "reward",
    "multimodal",
    "image_data",
}
_OUTPUT_KEYS = {
    "input_ids",
    "position_ids",
    "cu_seqlens",
    "cu_seqlens_padded",
    "max_seqlen",
    "max_seqlen_padded",
    "seqlens",
    "prompt_lens",
    "rewards",
    "token_rewards",
    "segment_ids",
    "finish_codes",
    "min_versions",
    "sample_ids",
    "group_ids",
    "token_keys",
    "pixel_values",
    "image_grid_thw",
    "image_counts",
    "image_data",
}


class PackingError(ValueError):
    """A sequence cannot be packed; the message names the sequence index and field."""


def _normalize(i: int, item: Union[Trajectory, Mapping[str, Any]]) -> dict:
    """Return {tokens: {name: 1-D array}, reward, prompt_len, scalars, ids} for one sequence."""
    if isinstance(item, Trajectory):
        tokens = {
            "input_ids": item.input_ids,
            "loss_mask": item.loss_mask,
            "logprobs": item.logprobs,
            "versions": item.versions,
            **item.token_extras,
        }
        return {
            "tokens": tokens,
            "reward": item.reward,
            "prompt_len": int(item.prompt_len),
            "scalars": {},
            "sample_id": item.sample_id,
            "group_id": item.group_id,
            "finish_reason": item.finish_reason,
            "multimodal": item.multimodal,
            "image_data": list(item.meta.get("image_data") or ()) if item.multimodal else [],
        }
    if not isinstance(item, Mapping):
        raise PackingError(
            f"sequence {i}: expected a Trajectory or a dict, got {type(item).__name__}"
        )
    if "input_ids" not in item:
        raise PackingError(f"sequence {i}: missing 'input_ids'")

    def arr(name, value, dtype=None):
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        a = np.asarray(value) if dtype is None else np.asarray(value, dtype=dtype)
        if a.dtype == object:
            raise PackingError(f"sequence {i}: field {name!r} is not numeric")
        return a

    ids = arr("input_ids", item["input_ids"])
    if ids.ndim != 1 or ids.shape[0] < 1 or ids.dtype.kind not in "iu":
        raise PackingError(
            f"sequence {i}: field 'input_ids' must be a non-empty 1-D integer "
            f"array, got dtype {ids.dtype} shape {tuple(ids.shape)}"
        )
    n = ids.shape[0]
    prompt_len = int(item.get("prompt_len", 0))
    if not 0 <= prompt_len <= n:
        raise PackingError(f"sequence {i}: field 'prompt_len'={prompt_len} not in [0, {n}]")
    tokens = {"input_ids": ids}
    for name, dtype in _DEFAULT_DTYPES.items():
        if name in item:
            tokens[name] = arr(name, item[name], dtype)
    if "loss_mask" not in tokens:
        lm = np.ones(n, np.uint8)
        lm[:prompt_len] = 0
        tokens["loss_mask"] = lm
    tokens.setdefault("logprobs", np.zeros(n, np.float32))
    tokens.setdefault("versions", np.full(n, -1, np.int32))
    scalars = {}
    for name, value in item.items():
        if name in tokens or name in _SCALAR_KEYS or name == "token_extras":
            continue
        if isinstance(value, (str, bytes, dict)) or value is None:
            continue
        a = arr(name, value)
        if a.ndim == 0:
            if name in _OUTPUT_KEYS:
                raise PackingError(
                    f"sequence {i}: per-sequence field {name!r} clashes with an output key"
                )
            scalars[name] = a
        else:
            tokens[name] = a
    for name, value in (item.get("token_extras") or {}).items():
        tokens[name] = arr(f"token_extras.{name}", value)
    return {
        "tokens": tokens,
        "reward": arr("reward", item.get("reward", 0.0), np.float32),
        "prompt_len": prompt_len,
        "scalars": scalars,
        "sample_id": str(item.get("sample_id", "")),
        "group_id": str(item.get("group_id", "")),
        "finish_reason": str(item.get("finish_reason", "stop")),
        "multimodal": item.get("multimodal") or {},
        "image_data": list(item.get("image_data") or ()),
    }


def pack_sequences(
    trajectories: Iterable[Union[Trajectory, Mapping[str, Any]]],
    *,
    pad_to_multiple: int = 1,
    cp_size: int = 1,
    pad_token_id: int = 0,
    like: Union[Trajectory, Mapping[str, Any], None] = None,
) -> dict[str, Any]:
    """Pack trajectories (or dicts with the same keys) into flat tensors; see module docstring.
    ``like``: a sequence of the same kind; an empty list then packs to padding carrying
    ``like``'s per-token fields (its dtypes and trailing shapes) besides the standard ones.

    Returns a dict with, for T packed tokens and B sequences:

    * per token [T] (an extra may be [T, ...]: ``routed_experts`` [T, layers, topk]):
      ``input_ids`` int64, ``position_ids`` int64 (restart at 0 per sequence),
      ``segment_ids`` int32, ``loss_mask`` uint8, ``logprobs`` float32, ``versions`` int32,
      ``labels`` int64 where the samples carry them (always in an empty pack),
      every per-token extra in its own dtype, and ``token_rewards`` float32 when any sequence
      has per-token rewards (a scalar reward is then placed on that sequence's last token);
    * per sequence [B]: ``seqlens`` / ``prompt_lens`` / ``min_versions`` int32, ``rewards``
      float32 (sum of per-token rewards where given), ``finish_codes`` int8 (index into
      :data:`FINISH_REASONS`, -1 if unknown), and each numeric scalar extra of dict inputs;
    * ``cu_seqlens`` / ``cu_seqlens_padded`` int32 [B+1], ``max_seqlen`` /
      ``max_seqlen_padded`` int, ``sample_ids`` / ``group_ids`` list[str], and
      ``token_keys`` (list[str], the names of the per-token tensors).

    Dict inputs need only ``input_ids``; missing ``loss_mask`` is 1 after ``prompt_len``,
    ``logprobs`` 0, ``versions`` -1, ``reward`` 0. Raises :class:`PackingError` naming the
    sequence and field on any inconsistency (lengths, dtypes, extras present in only some).
    """
    if pad_to_multiple < 1 or cp_size < 1:
        raise PackingError(f"pad_to_multiple={pad_to_multiple} and cp_size={cp_size} must be >= 1")
    slot_mult = 2 * cp_size if cp_size > 1 else 1
    if pad_to_multiple % slot_mult:
        raise PackingError(
            f"pad_to_multiple={pad_to_multiple} must be a multiple of "
            f"2*cp_size={slot_mult} (pass 2*TP*CP)"
        )
    seqs = [_normalize(i, t) for i, t in enumerate(trajectories)]
    b = len(seqs)
    lens = np.array([s["tokens"]["input_ids"].shape[0] for s in seqs], dtype=np.int64)
    slots = -(-lens // slot_mult) * slot_mult
    offsets = np.zeros(b + 1, np.int64)
    np.cumsum(slots, out=offsets[1:])
    used = int(offsets[-1])
    total = max(-(-used // pad_to_multiple) * pad_to_multiple, pad_to_multiple, slot_mult)

    # every sequence must carry the same per-token fields with a consistent dtype; an empty
    # pack carries the standard fields and those of ``like``
    fields = {k: np.zeros(0, v) for k, v in _DEFAULT_DTYPES.items()}
    if seqs:
        fields = seqs[0]["tokens"]
    elif like is not None:
        fields.update(_normalize(0, like)["tokens"])
    names = list(fields)
    dtypes = {k: fields[k].dtype for k in names}
    # a per-token field is [n] or [n, *trailing] with the same trailing shape in every sequence
    trailing = {k: tuple(fields[k].shape[1:]) for k in names}
    scalar_names = sorted(seqs[0]["scalars"]) if seqs else []
    for i, s in enumerate(seqs):
        n = int(lens[i])
        if set(s["tokens"]) != set(names):
            diff = sorted(set(s["tokens"]) ^ set(names))
            raise PackingError(
                f"sequence {i}: per-token field {diff[0]!r} present in some sequences only"
            )
        if sorted(s["scalars"]) != scalar_names:
            diff = sorted(set(s["scalars"]) ^ set(scalar_names))
            raise PackingError(
                f"sequence {i}: per-sequence field {diff[0]!r} present in some sequences only"
            )
        for k, a in s["tokens"].items():
            if a.shape != (n, *trailing[k]) or (k == "input_ids" and a.ndim != 1):
                want = ", ".join(str(d) for d in (n, *trailing[k]))
                raise PackingError(
                    f"sequence {i}: field {k!r} has shape {tuple(a.shape)}, "
                    f"expected ({want},) like input_ids"
                )
            if k != "input_ids" and a.dtype != dtypes[k]:
                raise PackingError(
                    f"sequence {i}: field {k!r} has dtype {a.dtype}, sequence 0 has {dtypes[k]}"
                )
        if s["reward"].shape not in ((), (n,)):
            raise PackingError(
                f"sequence {i}: field 'reward' has shape "
                f"{tuple(s['reward'].shape)}, expected () or ({n},)"
            )

    out: dict[str, Any] = {}
    starts = offsets[:-1]
    seg = np.full(total, b, np.int32)
    pos = np.arange(total, dtype=np.int64)
    for i in range(b):
        seg[offsets[i] : offsets[i + 1]] = i
        pos[offsets[i] : offsets[i + 1]] -= offsets[i]
    pos[used:] -= used
    ids = np.full(total, pad_token_id, np.int64)
    for i, s in enumerate(seqs):
        ids[starts[i] : starts[i] + lens[i]] = s["tokens"]["input_ids"]
    out["input_ids"] = torch.from_numpy(ids)
    out["position_ids"] = torch.from_numpy(pos)
    out["segment_ids"] = torch.from_numpy(seg)
    cu = np.zeros(b + 1, np.int32)
    np.cumsum(lens, out=cu[1:])
    out["cu_seqlens"] = torch.from_numpy(cu)
    out["cu_seqlens_padded"] = torch.from_numpy(offsets.astype(np.int32))
    out["max_seqlen"] = int(lens.max()) if b else 0
    out["max_seqlen_padded"] = int(slots.max()) if b else 0
    for k in names:
        if k == "input_ids":
            continue
        buf = np.full((total, *trailing[k]), PER_TOKEN_FILL.get(k, 0), dtypes[k])
        for i, s in enumerate(seqs):
            buf[starts[i] : starts[i] + lens[i]] = s["tokens"][k]
        out[k] = torch.from_numpy(buf)
    rewards = np.zeros(b, np.float32)
    per_token = any(s["reward"].ndim == 1 for s in seqs)
    tok_r = np.zeros(total, np.float32) if per_token else None
    for i, s in enumerate(seqs):
        r = s["reward"]
        rewards[i] = r.sum(dtype=np.float64) if r.ndim else r
        if tok_r is not None:
            if r.ndim:
                tok_r[starts[i] : starts[i] + lens[i]] = r
            else:
                tok_r[starts[i] + lens[i] - 1] = r
    out["rewards"] = torch.from_numpy(rewards)
    if tok_r is not None:
        out["token_rewards"] = torch.from_numpy(tok_r)
    out["seqlens"] = torch.from_numpy(lens.astype(np.int32))
    out["prompt_lens"] = torch.tensor([s["prompt_len"] for s in seqs], dtype=torch.int32)
    mv = []
    for s in seqs:
        v = s["tokens"]["versions"]
        v = v[v >= 0]
        mv.append(int(v.min()) if v.size else -1)
    out["min_versions"] = torch.tensor(mv, dtype=torch.int32)
    codes = {r: c for c, r in enumerate(FINISH_REASONS)}
    out["finish_codes"] = torch.tensor(
        [codes.get(s["finish_reason"], -1) for s in seqs], dtype=torch.int8
    )
    for k in scalar_names:
        out[k] = torch.from_numpy(np.stack([s["scalars"][k] for s in seqs]))
    out["token_keys"] = (
        ["input_ids", "position_ids", "segment_ids"]
        + [k for k in names if k != "input_ids"]
        + (["token_rewards"] if per_token else [])
    )
    out["sample_ids"] = [s["sample_id"] for s in seqs]
    out["group_ids"] = [s["group_id"] for s in seqs]
    out.update(pack_images([s["multimodal"] for s in seqs]))
    if any(s["image_data"] for s in seqs):  # the prompts' images as sent to the servers
        out["image_data"] = [s["image_data"] for s in seqs]
    return out


def pack_images(per_seq: Sequence[Mapping]) -> dict:
    """The images of packed sequences (each one's ``multimodal``, empty for text), in packed
    order: ``pixel_values`` / ``image_grid_thw`` (concatenated) and ``image_counts`` int32
    [B]; an empty dict when no sequence has images."""
    with_images = [(i, mm) for i, mm in enumerate(per_seq) if mm]
    if not with_images:
        return {}
    pixels, grids = [], []
    for i, mm in with_images:
        p, g = (np.asarray(mm[k]) for k in ("pixel_values", "image_grid_thw"))
        if p.ndim != 2 or g.ndim != 2 or g.shape[1] != 3:
            raise PackingError(
                f"sequence {i}: images of shape {tuple(p.shape)} / grid {tuple(g.shape)}, "
                "expected [patches, patch_dim] / [images, 3]"
            )
        if pixels and (p.shape[1] != pixels[0].shape[1] or p.dtype != pixels[0].dtype):
            raise PackingError(
                f"sequence {i}: field 'pixel_values' is {p.dtype} {tuple(p.shape)}, the "
                f"first sequence with images has {pixels[0].dtype} [*, {pixels[0].shape[1]}]"
            )
        pixels.append(p)
        grids.append(g)
    counts = np.zeros(len(per_seq), np.int32)
    for (i, _), g in zip(with_images, grids):
        counts[i] = g.shape[0]
    return {
        "pixel_values": torch.from_numpy(np.concatenate(pixels)),
        # int64 like the image processor's grids (what the vision tower was checked with)
        "image_grid_thw": torch.from_numpy(np.concatenate(grids).astype(np.int64)),
        "image_counts": torch.from_numpy(counts),
    }


def zigzag_index(bounds: Sequence[int], total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices kept by context-parallel rank ``cp_rank`` (zigzag / load-balanced split).

    ``bounds`` are the slot offsets (``cu_seqlens_padded``, B+1 entries); the trailing padding
    ``[bounds[-1], total)`` is one more segment. Each segment, of a length divisible by
    ``2·cp_size``, is cut into ``2·cp_size`` equal chunks and rank r keeps chunks r and
    ``2·cp_size−1−r`` (in that order), matching TransformerEngine's THD context parallelism.
    The engine's split/merge (:mod:`areal_mega.engine.packed`) use this same index."""
    if not 0 <= cp_rank < cp_size:
        raise PackingError(f"cp_rank={cp_rank} not in [0, cp_size={cp_size})")
    if cp_size == 1:
        return torch.arange(total)
    segs = list(bounds)
    if not segs or segs[0] != 0:
        segs = [0] + segs
    if segs[-1] < total:
        segs.append(total)
    n = 2 * cp_size
    parts = []
    for lo, hi in zip(segs[:-1], segs[1:]):
        c = _zigzag_chunk(lo, hi, cp_size)
        for k in (cp_rank, n - 1 - cp_rank):
            parts.append(torch.arange(lo + k * c, lo + (k + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _zigzag_chunk(lo: int, hi: int, cp_size: int) -> int:
    """Length of each of the ``2·cp_size`` chunks of segment ``[lo, hi)``, checked."""
    n = 2 * cp_size
    if (hi - lo) % n:
        raise PackingError(
            f"segment [{lo}, {hi}) is not a multiple of 2*cp_size={n}; pack with cp_size={cp_size}"
        )
    return (hi - lo) // n


def zigzag_shard_bounds(bounds: Sequence[int], cp_size: int) -> list[int]:
    """Slot offsets inside one CP rank's share (:func:`zigzag_index`).

    A rank keeps two of the ``2·cp_size`` equal chunks of every segment, one after the other,
    so slot ``b`` of the full batch (``[bounds[b], bounds[b+1])``) becomes
    ``[bounds[b] / cp_size, bounds[b+1] / cp_size)`` of every rank's share."""
    if cp_size == 1:
        return [int(b) for b in bounds]
    lo = 0
    for b in bounds:
        _zigzag_chunk(lo, int(b), cp_size)
        lo = int(b)
    return [int(b) // cp_size for b in bounds]


def zigzag_cp_shard(packed: Mapping[str, Any], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """Return this context-parallel rank's share of every per-token tensor of ``packed``.

    Each segment (every slot of ``cu_seqlens_padded`` and the trailing padding) is cut into
    ``2 * cp_size`` equal chunks; rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``
    (load-balanced causal attention). ``packed`` must come from :func:`pack_sequences` with the
    same ``cp_size``. Per-sequence entries and ``cu_seqlens*`` are returned unchanged (they
    describe the whole sequences, as TransformerEngine expects).
    """
    total = int(packed["input_ids"].shape[0])
    idx = zigzag_index(packed["cu_seqlens_padded"].tolist(), total, cp_size, cp_rank)
    out = {}
    token_keys = set(packed["token_keys"])
    for k, v in packed.items():
        if k in token_keys:
            out[k] = v.index_select(0, idx)
        else:
            out[k] = v
    return out

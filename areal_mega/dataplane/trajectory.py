"""The unit on the data plane: one finished sample (prompt + completion) with per-token fields.

Every per-token array has length ``L = prompt_len + completion_len``:

============== ======== =====================================================================
field          dtype    meaning
============== ======== =====================================================================
input_ids      int32    token ids of prompt and completion
loss_mask      uint8    1 on tokens the policy is trained on (generated tokens only), else 0
logprobs       float32  behaviour-policy log-probability of each token, 0 where loss_mask is 0
versions       int32    weight version that produced each token, -1 on prompt / env tokens
reward         float32  scalar per sample (shape ``()``) or per token (shape ``[L]``)
============== ======== =====================================================================

Metadata: ``sample_id`` (unique), ``group_id`` (same prompt), ``prompt_len``, ``finish_reason``
(``stop`` | ``length`` | ``abort``), ``created_at`` (unix seconds), ``server_id`` (rollout
server), ``meta`` (free-form JSON-able extras) and ``token_extras`` (extra per-token arrays of
length L, e.g. ``ref_logprobs`` or ``values``; ``routed_experts`` alone is ``(L, layers, topk)``
of an integer dtype, see :mod:`areal_mega.common.moe_routes`) and ``multimodal`` (the images of
the prompt: ``pixel_values`` / ``image_grid_thw``, empty for text, see
:mod:`areal_mega.dataplane.multimodal`).

:meth:`Trajectory.validate` checks every field and raises :class:`TrajectoryError` naming the
offending field; the data plane runs it on every received message.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from areal_mega.common.moe_routes import ROUTED_EXPERTS
from areal_mega.dataplane.multimodal import MULTIMODAL_KEYS, WIRE_PREFIX, multimodal_problem

FINISH_REASONS = ("stop", "length", "abort")
"""Allowed values of ``finish_reason``; packed batches encode them as their index here."""
_FINISH_REASON_SET = frozenset(FINISH_REASONS)

CORE_FIELDS = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "logprobs": np.dtype(np.float32),
    "versions": np.dtype(np.int32),
}
"""Per-token fields every trajectory carries, with their exact dtypes."""

REWARD_DTYPE = np.dtype(np.float32)
_I32, _U8, _F32 = np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.float32)

ALLOWED_EXTRA_DTYPES = frozenset(
    np.dtype(d)
    for d in (
        np.bool_,
        np.uint8,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.float16,
        np.float32,
        np.float64,
    )
)
"""dtypes accepted for ``token_extras`` (and therefore on the wire)."""

RESERVED_NAMES = frozenset(CORE_FIELDS) | {"reward", "position_ids", "cu_seqlens"}

_MIN = np.minimum.reduce
_MAX = np.maximum.reduce

# Bits of a value-rule failure (see failed_value_rules); validate raises the first in its order.
NEGATIVE_ID, MASK_NOT_BINARY, VERSION_BELOW, MASK_ON_PROMPT, BAD_LOGPROB = 1, 2, 4, 8, 16


def failed_value_rules(
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    logprobs: np.ndarray,
    versions: np.ndarray,
    prompt_len: int,
) -> int:
    """Bit mask of the value rules the core arrays break (0: all hold).

    Rules: :data:`NEGATIVE_ID` ``input_ids >= 0``; :data:`MASK_NOT_BINARY` ``loss_mask`` in
    {0, 1}; :data:`VERSION_BELOW` ``versions >= -1``; :data:`MASK_ON_PROMPT` ``loss_mask`` 0 on
    the first ``prompt_len`` tokens; :data:`BAD_LOGPROB` ``logprobs`` finite and <= 0 where
    ``loss_mask`` is not 0. The arrays must already have their contract dtypes and one length
    L >= 1, and ``0 <= prompt_len <= L``; any layout or byte offset. One SIMD reduction per
    array on the common path.
    """
    bits = 0
    if _MIN(input_ids) < 0:
        bits |= NEGATIVE_ID
    if _MAX(loss_mask) > 1:
        bits |= MASK_NOT_BINARY
    if _MIN(versions) < -1:
        bits |= VERSION_BELOW
    if prompt_len and _MAX(loss_mask[:prompt_len]):
        bits |= MASK_ON_PROMPT
    # Every logprob finite and <= 0 (NaN fails both comparisons) implies the rule on the trained
    # tokens; otherwise check exactly the tokens with a nonzero loss_mask.
    if not (_MAX(logprobs) <= 0.0 and _MIN(logprobs) > -np.inf):
        trained = logprobs[loss_mask != 0]
        if trained.size and not (np.isfinite(trained).all() and trained.max() <= 0.0):
            bits |= BAD_LOGPROB
    return bits


def _check_routes(key: str, arr: np.ndarray, n: int, sid: Optional[str]) -> None:
    """The one extra that is not ``(L,)``: MoE routes ``(L, layers, topk)`` of an integer
    dtype, expert ids >= -1 (-1: not forwarded; see :mod:`areal_mega.common.moe_routes`)."""
    if arr.dtype.kind not in "iu":
        raise TrajectoryError(key, f"dtype {arr.dtype}, expected an integer dtype", sid)
    if arr.ndim != 3 or arr.shape[0] != n or not arr.shape[1] or not arr.shape[2]:
        raise TrajectoryError(key, f"shape {tuple(arr.shape)}, expected ({n}, layers, topk)", sid)
    if arr.dtype.kind == "i" and _MIN(arr.reshape(-1)) < -1:
        raise TrajectoryError(key, f"expert id {int(arr.min())} < -1", sid)


class TrajectoryError(ValueError):
    """A trajectory field has a bad dtype, shape or value; the message names the field."""

    def __init__(self, field_name: str, problem: str, sample_id: Optional[str] = None):
        self.field = field_name
        self.problem = problem
        self.sample_id = sample_id
        where = f" (sample_id={sample_id!r})" if sample_id else ""
        super().__init__(f"trajectory field {field_name!r}: {problem}{where}")


def _as_array(name: str, value: Any, dtype: np.dtype, sample_id: Optional[str]) -> np.ndarray:
    """Convert to a numpy array of ``dtype`` without copying when it already is one."""
    if isinstance(value, np.ndarray):
        if value.dtype == dtype:
            return value
        if value.dtype.kind == "f" and dtype.kind in "iu":
            raise TrajectoryError(
                name, f"expected {dtype}, got float dtype {value.dtype}", sample_id
            )
        return value.astype(dtype)
    if hasattr(value, "numpy") and hasattr(value, "detach"):  # a CPU torch tensor
        value = value.detach().cpu().numpy()
        return _as_array(name, value, dtype, sample_id)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise TrajectoryError(name, f"not convertible to an array: {e}", sample_id) from None
    if arr.dtype == object:
        raise TrajectoryError(name, "not a numeric array", sample_id)
    if arr.size and arr.dtype.kind == "f" and dtype.kind in "iu":
        raise TrajectoryError(name, f"expected {dtype}, got float values", sample_id)
    return arr.astype(dtype, copy=False)


@dataclass
class Trajectory:
    """One finished sample; arrays are numpy (see the module docstring for the contract).

    Construction converts lists/tensors to the contract dtypes (no copy when they already
    match); call :meth:`validate` to check shapes and values.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: Any = 0.0
    sample_id: str = ""
    group_id: str = ""
    prompt_len: int = 0
    finish_reason: str = "stop"
    created_at: float = 0.0
    server_id: str = ""
    meta: dict = field(default_factory=dict)
    token_extras: dict = field(default_factory=dict)
    multimodal: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        sid = self.sample_id or None
        for name, dtype in CORE_FIELDS.items():
            setattr(self, name, _as_array(name, getattr(self, name), dtype, sid))
        self.reward = _as_array("reward", self.reward, REWARD_DTYPE, sid)
        extras = {}
        for name, arr in dict(self.token_extras).items():
            arr = (
                arr
                if isinstance(arr, np.ndarray)
                else _as_array(f"token_extras.{name}", arr, np.dtype(np.float32), sid)
            )
            extras[name] = arr
        self.token_extras = extras
        mm = self.multimodal
        if mm is None:
            self.multimodal = {}
        elif isinstance(mm, Mapping):
            self.multimodal = {
                k: _as_array(f"multimodal.{k}", v, MULTIMODAL_KEYS[k], sid)
                if k in MULTIMODAL_KEYS
                else v
                for k, v in mm.items()
            }
        if self.meta is None:
            self.meta = {}
        elif isinstance(self.meta, dict):
            self.meta = dict(self.meta)  # never share the caller's dict

    # ------------------------------------------------------------------ constructors
    @classmethod
    def _from_arrays(
        cls, arrays: dict, extras: dict, sample_id: Any, meta: Mapping, multimodal=None
    ) -> "Trajectory":
        """Build without ``__post_init__`` conversions, for :func:`decode_trajectory`.

        The caller guarantees every array in ``arrays`` (core fields and ``reward``) already has
        its contract dtype and every extra is an ndarray; the result is equal to the regular
        constructor's (which would not convert nor copy such arrays) and still needs
        :meth:`validate`. ``meta`` must be a fresh dict the trajectory may keep.
        """
        self = object.__new__(cls)
        m = meta.get("meta", {})
        d = self.__dict__
        d["input_ids"] = arrays["input_ids"]
        d["loss_mask"] = arrays["loss_mask"]
        d["logprobs"] = arrays["logprobs"]
        d["versions"] = arrays["versions"]
        d["reward"] = arrays["reward"]
        d["sample_id"] = sample_id
        d["group_id"] = meta.get("group_id", "")
        d["prompt_len"] = meta.get("prompt_len", 0)
        d["finish_reason"] = meta.get("finish_reason", "")
        d["created_at"] = meta.get("created_at", 0.0)
        d["server_id"] = meta.get("server_id", "")
        d["meta"] = {} if m is None else m
        d["token_extras"] = extras
        d["multimodal"] = {} if multimodal is None else multimodal
        return self

    @classmethod
    def from_tokens(
        cls,
        prompt_ids,
        completion_ids,
        completion_logprobs,
        completion_versions,
        *,
        reward: Any = 0.0,
        sample_id: Optional[str] = None,
        group_id: str = "",
        finish_reason: str = "stop",
        server_id: str = "",
        created_at: Optional[float] = None,
        meta: Optional[dict] = None,
        token_extras: Optional[dict] = None,
        multimodal: Optional[dict] = None,
    ) -> "Trajectory":
        """Build a trajectory from a prompt and its generated completion.

        Prompt tokens get ``loss_mask`` 0, ``logprobs`` 0 and ``versions`` -1; completion tokens
        get ``loss_mask`` 1 with the given logprobs and versions. ``sample_id`` defaults to a
        random UUID and ``created_at`` to now. ``multimodal``: the prompt's images (module
        docstring).
        """
        p = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        c = np.asarray(completion_ids, dtype=np.int32).reshape(-1)
        lp = np.asarray(completion_logprobs, dtype=np.float32).reshape(-1)
        vs = np.asarray(completion_versions, dtype=np.int32).reshape(-1)
        if not (len(c) == len(lp) == len(vs)):
            raise TrajectoryError(
                "completion",
                f"lengths differ: ids {len(c)}, logprobs {len(lp)}, versions {len(vs)}",
                sample_id,
            )
        n_p = len(p)
        return cls(
            input_ids=np.concatenate([p, c]),
            loss_mask=np.concatenate([np.zeros(n_p, np.uint8), np.ones(len(c), np.uint8)]),
            logprobs=np.concatenate([np.zeros(n_p, np.float32), lp]),
            versions=np.concatenate([np.full(n_p, -1, np.int32), vs]),
            reward=reward,
            sample_id=sample_id or uuid.uuid4().hex,
            group_id=group_id,
            prompt_len=n_p,
            finish_reason=finish_reason,
            server_id=server_id,
            created_at=time.time() if created_at is None else float(created_at),
            meta=dict(meta or {}),
            token_extras=dict(token_extras or {}),
            multimodal=dict(multimodal or {}),
        )

    # ------------------------------------------------------------------ properties
    @property
    def length(self) -> int:
        """Number of tokens L (prompt + completion)."""
        return int(self.input_ids.shape[0])

    @property
    def completion_len(self) -> int:
        """Number of tokens after the prompt."""
        return self.length - int(self.prompt_len)

    @property
    def per_token_reward(self) -> bool:
        """True when ``reward`` has one value per token."""
        return self.reward.ndim == 1

    @property
    def total_reward(self) -> float:
        """Scalar reward, or the sum of the per-token rewards."""
        return float(self.reward.sum(dtype=np.float64))

    @property
    def min_version(self) -> int:
        """Oldest weight version among generated tokens (``versions >= 0``); -1 if none."""
        v = self.versions[self.versions >= 0]
        return int(v.min()) if v.size else -1

    @property
    def max_version(self) -> int:
        """Newest weight version among generated tokens; -1 if none."""
        v = self.versions[self.versions >= 0]
        return int(v.max()) if v.size else -1

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return sum(a.nbytes for a in self.arrays().values())

    @property
    def n_images(self) -> int:
        """Images of the prompt (0 for a text sample)."""
        return int(self.multimodal["image_grid_thw"].shape[0]) if self.multimodal else 0

    def arrays(self) -> dict[str, np.ndarray]:
        """All arrays in wire order: core fields, ``reward``, ``token_extras`` by name, then
        the ``multimodal`` arrays as ``multimodal.<key>``."""
        out = {name: getattr(self, name) for name in CORE_FIELDS}
        out["reward"] = self.reward
        for name in sorted(self.token_extras):
            out[name] = self.token_extras[name]
        for name in sorted(self.multimodal):
            out[WIRE_PREFIX + name] = self.multimodal[name]
        return out

    def metadata(self) -> dict:
        """The non-array fields as a JSON-able dict."""
        return {
            "sample_id": self.sample_id,
            "group_id": self.group_id,
            "prompt_len": int(self.prompt_len),
            "finish_reason": self.finish_reason,
            "created_at": float(self.created_at),
            "server_id": self.server_id,
            "meta": self.meta,
        }

    # ------------------------------------------------------------------ checks
    def validate(self) -> "Trajectory":
        """Check dtypes, shapes and values; raise :class:`TrajectoryError` naming the field.

        Rules: every per-token array is 1-D of the same length L >= 1; ``input_ids >= 0``;
        ``loss_mask`` in {0, 1} and 0 on the prompt; ``versions >= -1``; ``logprobs`` finite and
        <= 0 where ``loss_mask`` is 1; ``reward`` finite, shape ``()`` or ``[L]``;
        ``0 <= prompt_len <= L``; ``finish_reason`` in :data:`FINISH_REASONS`; ``sample_id``
        non-empty; ``created_at`` finite; ``meta`` a dict; extras of allowed dtypes, length L,
        names not reserved nor starting with ``multimodal.`` (``routed_experts``: shape
        ``(L, layers, topk)``, integer, >= -1); ``multimodal`` empty or its two arrays
        consistent (:func:`~areal_mega.dataplane.multimodal.multimodal_problem`; the checks
        against a model's vision are the receiver's). Returns ``self`` so it can be chained.
        """
        sid = self.sample_id or None
        if type(sid) is not str and not isinstance(sid, str):
            raise TrajectoryError("sample_id", f"must be a non-empty str, got {self.sample_id!r}")
        if type(self.group_id) is not str or type(self.server_id) is not str:
            for name in ("group_id", "server_id"):
                if not isinstance(getattr(self, name), str):
                    raise TrajectoryError(
                        name, f"must be a str, got {type(getattr(self, name))}", sid
                    )
        ids, mask, lp, versions = self.input_ids, self.loss_mask, self.logprobs, self.versions
        if ids.ndim != 1 or ids.shape[0] < 1:
            raise TrajectoryError(
                "input_ids", f"must be 1-D with L >= 1, got shape {tuple(ids.shape)}", sid
            )
        n = ids.shape[0]
        shape = (n,)
        # one combined test on the common path (identity: decoded and constructed arrays carry
        # numpy's canonical dtype objects); the loop below names the culprit otherwise
        if not (
            ids.dtype is _I32
            and mask.dtype is _U8
            and lp.dtype is _F32
            and versions.dtype is _I32
            and mask.shape == shape
            and lp.shape == shape
            and versions.shape == shape
        ):
            for name, dtype in CORE_FIELDS.items():
                arr = getattr(self, name)
                if arr.dtype != dtype:
                    raise TrajectoryError(name, f"dtype {arr.dtype}, expected {dtype}", sid)
                if arr.shape != shape:
                    raise TrajectoryError(name, f"shape {tuple(arr.shape)}, expected ({n},)", sid)
        pl = self.prompt_len
        pl_ok = not isinstance(pl, bool) and isinstance(pl, (int, np.integer)) and 0 <= pl <= n
        bits = failed_value_rules(ids, mask, lp, versions, int(pl) if pl_ok else 0)
        if bits & NEGATIVE_ID:
            raise TrajectoryError("input_ids", f"negative token id {int(ids.min())}", sid)
        if bits & MASK_NOT_BINARY:
            raise TrajectoryError("loss_mask", "values must be 0 or 1", sid)
        if bits & VERSION_BELOW:
            raise TrajectoryError("versions", f"value {int(versions.min())} < -1", sid)
        if not pl_ok:
            raise TrajectoryError("prompt_len", f"{pl!r} must be an int in [0, {n}]", sid)
        if bits & MASK_ON_PROMPT:
            raise TrajectoryError("loss_mask", "is 1 on a prompt token", sid)
        if bits & BAD_LOGPROB:
            raise TrajectoryError("logprobs", "must be finite and <= 0 where loss_mask is 1", sid)
        r = self.reward
        if r.dtype is not _F32 and r.dtype != REWARD_DTYPE or r.shape not in ((), shape):
            raise TrajectoryError(
                "reward",
                f"dtype {r.dtype} shape {tuple(r.shape)}, expected float32 of shape () or ({n},)",
                sid,
            )
        if not (
            math.isfinite(r) if r.ndim == 0 else math.isfinite(_MAX(r)) and math.isfinite(_MIN(r))
        ):
            raise TrajectoryError("reward", "must be finite", sid)
        if not (type(self.finish_reason) is str and self.finish_reason in _FINISH_REASON_SET):
            raise TrajectoryError(
                "finish_reason", f"{self.finish_reason!r} not in {FINISH_REASONS}", sid
            )
        ca = self.created_at
        if (
            type(ca) is not float
            and (isinstance(ca, bool) or not isinstance(ca, (int, float)))
            or not math.isfinite(ca)
        ):
            raise TrajectoryError("created_at", f"{ca!r} must be a finite number", sid)
        if type(self.meta) is not dict and not isinstance(self.meta, dict):
            raise TrajectoryError("meta", f"must be a dict, got {type(self.meta).__name__}", sid)
        if self.multimodal or type(self.multimodal) is not dict:
            problem = multimodal_problem(self.multimodal)
            if problem is not None:
                raise TrajectoryError(*problem, sid)
        if not self.token_extras:
            return self
        for name, arr in self.token_extras.items():
            key = f"token_extras.{name}"
            if (
                not isinstance(name, str)
                or not name
                or name in RESERVED_NAMES
                or name.startswith(WIRE_PREFIX)
            ):
                raise TrajectoryError(
                    key, f"name must be a non-empty str, not one of {sorted(RESERVED_NAMES)}", sid
                )
            if not isinstance(arr, np.ndarray) or arr.dtype not in ALLOWED_EXTRA_DTYPES:
                raise TrajectoryError(
                    key, f"dtype {getattr(arr, 'dtype', type(arr))} not allowed", sid
                )
            if name == ROUTED_EXPERTS:
                _check_routes(key, arr, n, sid)
            elif arr.shape != (n,):
                raise TrajectoryError(key, f"shape {tuple(arr.shape)}, expected ({n},)", sid)
        return self

    # ------------------------------------------------------------------ comparison
    def equals(self, other: "Trajectory") -> bool:
        """Bit-exact equality of every array (dtype, shape, bytes) and every metadata field."""
        if not isinstance(other, Trajectory) or self.metadata() != other.metadata():
            return False
        a, b = self.arrays(), other.arrays()
        if a.keys() != b.keys():
            return False
        return all(
            x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
            for x, y in ((a[k], b[k]) for k in a)
        )

    def to_dict(self) -> dict:
        """Arrays and metadata in one flat dict (arrays are not copied)."""
        out: dict = dict(self.arrays())
        out.update(self.metadata())
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Trajectory":
        """Inverse of :meth:`to_dict`: unknown array entries become ``token_extras``."""
        known = set(CORE_FIELDS) | {
            "reward",
            "sample_id",
            "group_id",
            "prompt_len",
            "finish_reason",
            "created_at",
            "server_id",
            "meta",
        }
        missing = [k for k in CORE_FIELDS if k not in d]
        if missing:
            raise TrajectoryError(missing[0], "missing", d.get("sample_id"))
        extras = {
            k: v for k, v in d.items() if k not in known and k not in ("token_extras", "multimodal")
        }
        extras.update(d.get("token_extras") or {})
        kwargs = {k: d[k] for k in known if k in d}
        mm = dict(d.get("multimodal") or {})
        for k in [k for k in extras if k.startswith(WIRE_PREFIX)]:
            mm[k[len(WIRE_PREFIX) :]] = extras.pop(k)
        return cls(token_extras=extras, multimodal=mm, **kwargs)

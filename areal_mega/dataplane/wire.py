"""Wire format of a :class:`Trajectory`: a ZMQ multipart message, no pickle anywhere.

Frame 0 is a msgpack map (the header)::

    {"schema": 2, "sample_id": str,
     "fields": [[name: str, dtype: "<i4", shape: [L], packed: bool], ...],
     "meta": {"group_id", "prompt_len", "finish_reason", "created_at", "server_id", "meta"}}

A trajectory's images (``Trajectory.multimodal``) are two more fields,
``multimodal.pixel_values`` (float32 [patches, patch_dim]) and ``multimodal.image_grid_thw``
(int32 [images, 3]), packed or in frames of their own like any field (pixels of more than
:data:`PACK_THRESHOLD` bytes travel zero-copy).

Frame 1 is the *pack*: the raw bytes of every field with ``packed`` true, in field order, each
starting at the next multiple of 8 bytes (zero padding between, none after the last); it is
empty when no field is packed. Frames ``2, 3, ...`` are the raw bytes of the other fields, one
frame per field in field order, sent zero-copy. All arrays are little-endian, C order.
The sender packs the fields smaller than :data:`PACK_THRESHOLD` (ZMQ would copy such small
frames anyway), so a short trajectory is three frames and a long one ships its big arrays
without a copy; the receiver takes whatever the header declares.

With a shared secret, frame 0 ends with the 32-byte HMAC-SHA256 of the msgpack header
followed by every later frame in order (their lengths are fixed by the authenticated shapes,
so the concatenation is unambiguous); the receiver verifies it before parsing anything.

:func:`decode_trajectory` checks everything before trusting it and raises :class:`WireError`
with a short machine-readable ``reason`` (one of :data:`REJECT_REASONS`) and a detail naming
the frame or field; the receiver counts reasons and keeps running.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import sys
from typing import Any, Optional, Sequence, Union

import msgpack
import numpy as np
from zmq import Frame as _Frame

from areal_mega.dataplane.multimodal import MULTIMODAL_KEYS, WIRE_PREFIX
from areal_mega.dataplane.trajectory import (
    ALLOWED_EXTRA_DTYPES,
    CORE_FIELDS,
    Trajectory,
    TrajectoryError,
)

SCHEMA_VERSION = 2
"""Bumped on any incompatible change of the header or frame layout (2: small fields packed)."""

MAC_BYTES = 32
"""HMAC-SHA256 digest appended to frame 0 when a shared secret is configured."""

PACK_THRESHOLD = 64 * 1024
"""Fields smaller than this many bytes travel in the pack frame (ZMQ copies frames this small
anyway, and one frame costs less to send and receive than several)."""

REJECT_REASONS = (
    "bad_header",
    "schema",
    "missing_hmac",
    "bad_hmac",
    "frame_count",
    "bad_dtype",
    "bad_shape",
    "frame_size",
    "oversize",
    "invalid_field",
)
"""Why :func:`decode_trajectory` drops a message (counted per reason by the receiver)."""

MAX_NDIM = 4
_DTYPES = {
    np.dtype(d).newbyteorder("<").str: np.dtype(np.dtype(d).newbyteorder("<").str)
    for d in ALLOWED_EXTRA_DTYPES
}
"""Wire dtype string -> dtype; ``np.dtype("<i4")`` is numpy's canonical object on a
little-endian host, so decoded arrays pass the identity checks of ``Trajectory.validate``."""
_DTYPE_ITEMSIZE = {s: (dt, dt.itemsize) for s, dt in _DTYPES.items()}
_LITTLE = sys.byteorder == "little"
_WIRE_STR = {dt: dt.str for dt in _DTYPES.values()}
"""Wire dtype string of each little-endian dtype (on a little-endian host these compare equal
to the native ones, so ``a.dtype`` of a native array finds its entry)."""
_META_KEYS = frozenset(
    ("group_id", "prompt_len", "finish_reason", "created_at", "server_id", "meta")
)
_REQUIRED_DTYPE = {
    name: _DTYPES[dt.newbyteorder("<").str]
    for name, dt in (*CORE_FIELDS.items(), ("reward", np.dtype(np.float32)))
}
"""Fields every message carries, with the exact dtype each must have (the ``_DTYPES`` objects,
so they compare by identity)."""

_PADDING = [bytes(k) for k in range(8)]

Secret = Union[str, bytes, None]


class WireError(ValueError):
    """A message failed a check; ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def secret_bytes(secret: Secret) -> Optional[bytes]:
    """Normalise a shared secret (str is UTF-8 encoded; empty means none)."""
    if secret is None or secret == "" or secret == b"":
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _mac(key: bytes, header: Any, frames: Sequence[Any]) -> bytes:
    h = _hmac.new(key, header, hashlib.sha256)
    for f in frames:
        h.update(f)
    return h.digest()


def _hmac_failure(head: Any) -> WireError:
    """The error for a frame 0 whose HMAC does not verify: ``missing_hmac`` when the whole
    frame is a header (the sender has no secret), else ``bad_hmac``; names the claimed (not
    trusted) sample_id when there is one."""
    for body, reason in ((head, "missing_hmac"), (memoryview(head)[:-MAC_BYTES], "bad_hmac")):
        try:
            header = msgpack.unpackb(body, raw=False)
        except Exception:  # noqa: BLE001 - garbage: nothing to name
            continue
        if type(header) is dict and "schema" in header:
            sid = str(header.get("sample_id"))[:64]
            if reason == "missing_hmac":
                return WireError(
                    reason, f"sample_id={sid!r} is not signed but a secret is configured"
                )
            return WireError(reason, f"HMAC mismatch for (claimed) sample_id={sid!r}")
    return WireError("bad_hmac", "HMAC mismatch")


def _pack_fields(arrays: dict, wire_str: dict, pack_threshold: int) -> tuple:
    """``(fields, pack, own)``: the header's field specs, the pack (every array smaller than
    ``pack_threshold`` bytes, in order, 8-byte aligned, zero padding) and the other arrays
    (C-contiguous, little-endian) for frames of their own."""
    fields, parts, frames = [], [], []
    end = 0  # bytes of the pack so far
    for name, arr in arrays.items():
        a = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)  # keeps 0-d shape
        dt = wire_str.get(a.dtype)  # little-endian or native (little-endian host) dtypes
        if dt is None:
            if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
                a = a.astype(a.dtype.newbyteorder("<"))
            dt = a.dtype.newbyteorder("<").str
        nbytes = a.nbytes
        packed = nbytes < pack_threshold
        fields.append([name, dt, list(a.shape), packed])
        if packed:
            if end & 7:
                parts.append(_PADDING[8 - (end & 7)])
                end = (end + 7) & -8
            parts.append(a)
            end += nbytes
        else:
            frames.append(a)
    return fields, b"".join(parts), frames


def encode_trajectory(
    traj: Trajectory, secret: Secret = None, *, pack_threshold: int = PACK_THRESHOLD
) -> list:
    """Encode into ``[header, pack, array, array, ...]`` ready for ``send``.

    Fields smaller than ``pack_threshold`` bytes are copied into the pack (``bytes``);
    larger ones are returned as C-contiguous little-endian numpy arrays (no copy when they
    already are), so a zero-copy send ships the caller's memory: do not modify them until
    sent. Raises ``TypeError`` if ``meta`` holds something msgpack cannot encode.
    """
    fields, pack, frames = _pack_fields(traj.arrays(), _WIRE_STR, pack_threshold)
    frames.insert(0, pack)
    md = traj.metadata()
    header = {
        "schema": SCHEMA_VERSION,
        "sample_id": md.pop("sample_id"),
        "fields": fields,
        "meta": md,
    }
    head = msgpack.packb(header, use_bin_type=True)
    key = secret_bytes(secret)
    if key is not None:
        head += _mac(key, head, frames)
    frames.insert(0, head)
    return frames


def encode_record(traj: Trajectory, packer: Optional[msgpack.Packer] = None) -> bytes:
    """One trajectory as a self-delimiting msgpack record of its wire frames: the on-disk
    format of buffer files and the trainer's journal (read back with
    :func:`decode_trajectory` on each unpacked record)."""
    frames = [bytes(memoryview(f)) for f in encode_trajectory(traj)]
    return (packer or msgpack.Packer(use_bin_type=True)).pack(frames)


def _buf(frame: Any) -> Any:
    """A zero-copy byte buffer whose ``len()`` is its size in bytes: a ``zmq.Frame`` or
    ``bytes`` as is, anything else with the buffer protocol as a flat byte memoryview."""
    if type(frame) is _Frame or type(frame) is bytes:
        return frame
    b = getattr(frame, "buffer", None)  # a zmq.Frame subclass
    mv = memoryview(b if b is not None else frame)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _field_frames(fields: list) -> Union[int, tuple]:
    """Frames of their own that ``fields`` declares (the unpacked fields), after checking each
    entry is ``[str, dtype, shape, bool]``; ``(reason, detail)`` when one is not."""
    n_own = 0
    for i, spec in enumerate(fields):
        if (
            type(spec) is not list
            or len(spec) != 4
            or type(spec[0]) is not str
            or type(spec[3]) is not bool
        ):
            return "bad_header", f"fields[{i}] is not [name, dtype, shape, packed]"
        n_own += not spec[3]
    return n_own


def _decode_fields(fields: list, views: list, dtypes: dict, required: dict, sid: str) -> tuple:
    """``(arrays, n_required)``: a zero-copy array per field (``views[1]`` is the pack, then
    one view per unpacked field) and how many of them are ``required`` names; or
    ``(reason, detail)`` for the first failed check (dtype allowed and as required, shape,
    bytes in the pack or the field's frame, no duplicate, pack fully used).
    ``fields`` passed :func:`_field_frames` and ``views`` has its frame count."""
    arrays = {}
    pack = views[1]
    pack_len = len(pack)
    end = 0  # bytes of the pack used so far
    k = 2  # next field frame
    n_required = 0
    for name, dt, shape, packed in fields:
        entry = dtypes.get(dt) if type(dt) is str else None
        if entry is None:
            return "bad_dtype", f"field {name!r}: dtype {dt!r} not allowed"
        dtype, itemsize = entry
        want = required.get(name)
        if want is not None and dtype is not want:
            return "bad_dtype", (
                f"field {name!r}: dtype {dtype}, expected {want} (sample_id={sid!r})"
            )
        # exact ints only (msgpack yields int, never a subclass; excludes bool); each dimension
        # < 2**40 and at most MAX_NDIM of them keep the checks cheap
        if type(shape) is not list or len(shape) > MAX_NDIM:
            return "bad_shape", f"field {name!r}: shape {shape!r}"
        count = 1
        for d in shape:
            if type(d) is not int or not 0 <= d < 1 << 40:
                return "bad_shape", f"field {name!r}: shape {shape!r}"
            count *= d
        nbytes = count * itemsize
        if packed:
            start = (end + 7) & -8
            end = start + nbytes
            if end > pack_len:
                return "frame_size", (
                    f"frame 1 (pack) field {name!r}: needs bytes "
                    f"[{start}, {end}), the pack has {pack_len}"
                )
            arr = np.frombuffer(pack, dtype, count, start)  # zero-copy view, read-only
        else:
            view = views[k]
            if nbytes != len(view):
                return "frame_size", (
                    f"frame {k} field {name!r}: {len(view)} bytes, shape "
                    f"{shape} of {dtype} needs {nbytes}"
                )
            arr = np.frombuffer(view, dtype, count, 0)
            k += 1
        if name in arrays:
            return "bad_header", f"duplicate field {name!r}"
        arrays[name] = arr if len(shape) == 1 else arr.reshape(shape)
        n_required += want is not None
    if end != pack_len:
        return "frame_size", f"frame 1 (pack): {pack_len} bytes, the packed fields end at {end}"
    return arrays, n_required


def decode_trajectory(
    frames: Sequence[Any],
    secret: Secret = None,
    *,
    max_message_bytes: int = 1 << 30,
    validate: bool = True,
) -> Trajectory:
    """Decode and check one multipart message; arrays are zero-copy views on the frames.

    Checks, in order: total size, HMAC (when a secret is given; then a missing or wrong HMAC
    is rejected), header msgpack and structure, schema version, frame count, each field's
    dtype (whitelist, little-endian) / shape / bytes in its frame or the pack, then
    :meth:`Trajectory.validate`. Raises :class:`WireError` naming the frame or field.
    """
    if not frames:
        raise WireError("frame_count", "empty message")
    try:
        views = [_buf(f) for f in frames]
    except (TypeError, ValueError) as e:  # not a buffer, or a non-contiguous one
        raise WireError("frame_size", f"frame is not a contiguous buffer: {e}") from None
    total = sum(map(len, views))
    if total > max_message_bytes:
        raise WireError("oversize", f"{total} bytes > max_message_bytes={max_message_bytes}")
    head = views[0]
    key = secret_bytes(secret)
    if key is not None:  # authenticate before parsing anything
        head = memoryview(head)
        if len(head) <= MAC_BYTES:
            raise WireError(
                "missing_hmac",
                f"frame 0 has {len(head)} bytes: no room for the HMAC a configured secret requires",
            )
        head, mac = head[:-MAC_BYTES], head[-MAC_BYTES:]
        if not _hmac.compare_digest(mac, _mac(key, head, views[1:])):
            raise _hmac_failure(views[0])
    try:
        header = msgpack.unpackb(head, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_header", f"frame 0 is not msgpack: {type(e).__name__}: {e}") from None
    if type(header) is not dict:
        raise WireError("bad_header", f"frame 0 is a {type(header).__name__}, expected a map")
    if header.get("schema") != SCHEMA_VERSION:
        raise WireError("schema", f"schema {header.get('schema')!r}, expected {SCHEMA_VERSION}")
    sample_id = header.get("sample_id")
    fields = header.get("fields")
    meta = header.get("meta")
    if type(sample_id) is not str or type(fields) is not list or type(meta) is not dict:
        raise WireError("bad_header", "header needs str 'sample_id', list 'fields', map 'meta'")
    n_own = _field_frames(fields)
    if type(n_own) is tuple:
        raise WireError(*n_own)
    if len(views) != n_own + 2:
        raise WireError(
            "frame_count",
            f"{len(views)} frames, header declares header + pack + "
            f"{n_own} field frames (sample_id={sample_id[:64]!r})",
        )
    required = _REQUIRED_DTYPE
    decoded = _decode_fields(fields, views, _DTYPE_ITEMSIZE, required, sample_id[:64])
    if type(decoded[0]) is str:
        raise WireError(*decoded)
    arrays, n_required = decoded
    if n_required != len(required):
        missing = [n for n in required if n not in arrays]
        raise WireError(
            "invalid_field", f"field {missing[0]!r} missing (sample_id={sample_id[:64]!r})"
        )
    if not _META_KEYS.issuperset(meta):
        key = next(k for k in meta if k not in _META_KEYS)
        raise WireError("bad_header", f"meta key {key!r} not allowed")
    extras = (
        {n: a for n, a in arrays.items() if n not in required}
        if len(arrays) > len(required)
        else {}
    )
    mm = None
    if extras and any(n.startswith(WIRE_PREFIX) for n in extras):
        mm = {}
        for name in [n for n in extras if n.startswith(WIRE_PREFIX)]:
            arr = extras.pop(name)
            key = name[len(WIRE_PREFIX) :]
            want = MULTIMODAL_KEYS.get(key)
            if want is not None and arr.dtype != want:
                raise WireError(
                    "bad_dtype",
                    f"field {name!r}: dtype {arr.dtype}, expected {want} "
                    f"(sample_id={sample_id[:64]!r})",
                )
            mm[key] = arr
    # Every core array has its contract dtype (checked above), so the checked constructor
    # would neither convert nor copy: build directly, then run the full validation.
    traj = Trajectory._from_arrays(arrays, extras, sample_id, meta, mm)
    if validate:
        try:
            traj.validate()
        except TrajectoryError as e:
            raise WireError("invalid_field", str(e)) from None
    return traj

"""Wire format of a :class:`Trajectory`: a ZMQ multipart message, no pickle anywhere.

Frame 0 is a msgpack map (the header)::

    {"schema": 1, "sample_id": str,
     "fields": [{"name": str, "dtype": "<i4", "shape": [L]}, ...],
     "meta": {"group_id", "prompt_len", "finish_reason", "created_at", "server_id", "meta"},
     "hmac": bytes(32)}          # only when a shared secret is configured

Frame ``k >= 1`` is the raw little-endian bytes of ``fields[k-1]`` (C order), sent zero-copy.
``hmac`` is HMAC-SHA256 over the msgpack encoding of the header without the ``hmac`` key
followed by every tensor frame in order (frame lengths are fixed by the authenticated
shapes, so the concatenation is unambiguous).

:func:`decode_trajectory` checks everything before trusting it and raises :class:`WireError`
with a short machine-readable ``reason`` (one of :data:`REJECT_REASONS`) and a detail naming
the frame or field; the receiver counts reasons and keeps running.
"""
from __future__ import annotations

import hmac as _hmac
import hashlib
import sys
from typing import Any, Optional, Sequence, Union

import msgpack
import numpy as np
from zmq import Frame as _Frame

from areal_mega.dataplane.trajectory import (ALLOWED_EXTRA_DTYPES, CORE_FIELDS, Trajectory,
                                             TrajectoryError)

SCHEMA_VERSION = 1
"""Bumped on any incompatible change of the header or frame layout."""

REJECT_REASONS = ("bad_header", "schema", "missing_hmac", "bad_hmac", "frame_count",
                  "bad_dtype", "bad_shape", "frame_size", "oversize", "invalid_field")
"""Why :func:`decode_trajectory` drops a message (counted per reason by the receiver)."""

MAX_NDIM = 4
_DTYPES = {np.dtype(d).newbyteorder("<").str: np.dtype(d).newbyteorder("<")
           for d in ALLOWED_EXTRA_DTYPES}
_LITTLE = sys.byteorder == "little"
_WIRE_STR = {dt: dt.str for dt in _DTYPES.values()}
"""Wire dtype string of each little-endian dtype (on a little-endian host these compare equal
to the native ones, so ``a.dtype`` of a native array finds its entry)."""
_META_KEYS = frozenset(("group_id", "prompt_len", "finish_reason", "created_at", "server_id",
                        "meta"))
_REQUIRED_DTYPE = {name: _DTYPES[dt.newbyteorder("<").str]
                   for name, dt in (*CORE_FIELDS.items(), ("reward", np.dtype(np.float32)))}
"""Fields every message carries, with the exact dtype each must have (the ``_DTYPES`` objects,
so they compare by identity)."""

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


def _mac(key: bytes, header_wo_mac: bytes, frames: Sequence[Any]) -> bytes:
    h = _hmac.new(key, header_wo_mac, hashlib.sha256)
    for f in frames:
        h.update(f)
    return h.digest()


def encode_trajectory(traj: Trajectory, secret: Secret = None) -> list:
    """Encode into ``[header_bytes, array, array, ...]`` ready for ``send_multipart``.

    Arrays are returned as C-contiguous little-endian numpy arrays (no copy when they already
    are), so a zero-copy send ships the caller's memory: do not modify them until sent.
    Raises ``TypeError`` if ``meta`` holds something msgpack cannot encode.
    """
    fields, frames = [], []
    wire_str = _WIRE_STR
    for name, arr in traj.arrays().items():
        a = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)  # keeps 0-d shape
        dt = wire_str.get(a.dtype)  # little-endian or native (little-endian host) dtypes
        if dt is None:
            if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
                a = a.astype(a.dtype.newbyteorder("<"))
            dt = a.dtype.newbyteorder("<").str
        fields.append({"name": name, "dtype": dt, "shape": list(a.shape)})
        frames.append(a)
    md = traj.metadata()
    header = {"schema": SCHEMA_VERSION, "sample_id": md.pop("sample_id"), "fields": fields,
              "meta": md}
    head = msgpack.packb(header, use_bin_type=True)
    key = secret_bytes(secret)
    if key is not None:
        header["hmac"] = _mac(key, head, frames)
        head = msgpack.packb(header, use_bin_type=True)
    return [head] + frames


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


def decode_trajectory(frames: Sequence[Any], secret: Secret = None, *,
                      max_message_bytes: int = 1 << 30, validate: bool = True) -> Trajectory:
    """Decode and check one multipart message; arrays are zero-copy views on the frames.

    Checks, in order: total size, header msgpack and structure, schema version, frame count,
    HMAC (when a secret is given; then a missing or wrong HMAC is rejected), each field's
    dtype (whitelist, little-endian) / shape / frame length, then
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
    try:
        header = msgpack.unpackb(views[0], raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_header", f"frame 0 is not msgpack: {type(e).__name__}: {e}"
                        ) from None
    if type(header) is not dict:
        raise WireError("bad_header", f"frame 0 is a {type(header).__name__}, expected a map")
    if header.get("schema") != SCHEMA_VERSION:
        raise WireError("schema", f"schema {header.get('schema')!r}, expected "
                        f"{SCHEMA_VERSION}")
    sample_id = header.get("sample_id")
    fields = header.get("fields")
    meta = header.get("meta")
    if type(sample_id) is not str or type(fields) is not list or type(meta) is not dict:
        raise WireError("bad_header", "header needs str 'sample_id', list 'fields', map 'meta'")
    if len(views) != len(fields) + 1:
        raise WireError("frame_count", f"{len(views)} frames, header declares "
                        f"{len(fields)} fields + 1 header (sample_id={sample_id[:64]!r})")
    key = secret_bytes(secret)
    if key is not None:
        mac = header.pop("hmac", None)
        if not isinstance(mac, bytes):
            raise WireError("missing_hmac", "header has no 'hmac' but a secret is configured")
        expected = _mac(key, msgpack.packb(header, use_bin_type=True), views[1:])
        if not _hmac.compare_digest(mac, expected):
            raise WireError("bad_hmac", f"HMAC mismatch for sample_id="
                            f"{str(header.get('sample_id'))[:64]!r}")
    arrays = {}
    dtypes = _DTYPES
    required = _REQUIRED_DTYPE
    for k, spec in enumerate(fields, start=1):
        if type(spec) is not dict or type(spec.get("name")) is not str:
            raise WireError("bad_header", f"fields[{k - 1}] is not {{name, dtype, shape}}")
        name = spec["name"]
        dt = spec.get("dtype")
        dtype = dtypes.get(dt) if type(dt) is str else None
        if dtype is None:
            raise WireError("bad_dtype", f"frame {k} field {name!r}: dtype {dt!r} not allowed")
        want = required.get(name)
        if want is not None and dtype is not want:
            raise WireError("bad_dtype", f"field {name!r}: dtype {dtype}, "
                            f"expected {want} (sample_id={sample_id[:64]!r})")
        shape = spec.get("shape")
        # exact ints only (msgpack yields int, never a subclass; excludes bool); each dimension
        # < 2**40 and at most MAX_NDIM of them keep the product exact and the check cheap
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise WireError("bad_shape", f"frame {k} field {name!r}: shape {shape!r}")
        count = 1
        for d in shape:
            if type(d) is not int or not 0 <= d < 1 << 40:
                raise WireError("bad_shape", f"frame {k} field {name!r}: shape {shape!r}")
            count *= d
        view = views[k]
        if count * dtype.itemsize != len(view):
            raise WireError("frame_size", f"frame {k} field {name!r}: {len(view)} bytes, "
                            f"shape {shape} of {dtype} needs {count * dtype.itemsize}")
        if name in arrays:
            raise WireError("bad_header", f"frame {k}: duplicate field {name!r}")
        arr = np.frombuffer(view, dtype=dtype)  # zero-copy view on the frame, read-only
        arrays[name] = arr if len(shape) == 1 else arr.reshape(shape)
    if len(arrays) < len(required) or not all(n in arrays for n in required):
        missing = [n for n in required if n not in arrays]
        raise WireError("invalid_field", f"field {missing[0]!r} missing "
                        f"(sample_id={sample_id[:64]!r})")
    for key in meta:
        if key not in _META_KEYS:
            raise WireError("bad_header", f"meta key {key!r} not allowed")
    extras = {n: a for n, a in arrays.items() if n not in required} \
        if len(arrays) > len(required) else {}
    # Every core array has its contract dtype (checked above), so the checked constructor
    # would neither convert nor copy: build directly, then run the full validation.
    traj = Trajectory._from_arrays(arrays, extras, sample_id, meta)
    if validate:
        try:
            traj.validate()
        except TrajectoryError as e:
            raise WireError("invalid_field", str(e)) from None
    return traj

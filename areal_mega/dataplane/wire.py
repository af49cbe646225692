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
from typing import Any, Optional, Sequence, Union

import msgpack
import numpy as np

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
_META_KEYS = ("group_id", "prompt_len", "finish_reason", "created_at", "server_id", "meta")

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
    for name, arr in traj.arrays().items():
        a = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)  # keeps 0-d shape
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        fields.append({"name": name, "dtype": a.dtype.newbyteorder("<").str,
                       "shape": list(a.shape)})
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


def _buf(frame: Any) -> memoryview:
    """A memoryview on a zmq.Frame, bytes or buffer-protocol object (no copy)."""
    b = getattr(frame, "buffer", None)
    return memoryview(b if b is not None else frame)


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
    views = [_buf(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_message_bytes:
        raise WireError("oversize", f"{total} bytes > max_message_bytes={max_message_bytes}")
    try:
        header = msgpack.unpackb(views[0], raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_header", f"frame 0 is not msgpack: {type(e).__name__}: {e}"
                        ) from None
    if not isinstance(header, dict):
        raise WireError("bad_header", f"frame 0 is a {type(header).__name__}, expected a map")
    if header.get("schema") != SCHEMA_VERSION:
        raise WireError("schema", f"schema {header.get('schema')!r}, expected "
                        f"{SCHEMA_VERSION}")
    sample_id = header.get("sample_id")
    fields = header.get("fields")
    meta = header.get("meta")
    if not isinstance(sample_id, str) or not isinstance(fields, list) or \
            not isinstance(meta, dict):
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
    for k, (spec, view) in enumerate(zip(fields, views[1:]), start=1):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise WireError("bad_header", f"fields[{k - 1}] is not {{name, dtype, shape}}")
        name = spec["name"]
        dtype = _DTYPES.get(spec.get("dtype")) if isinstance(spec.get("dtype"), str) else None
        if dtype is None:
            raise WireError("bad_dtype", f"frame {k} field {name!r}: dtype "
                            f"{spec.get('dtype')!r} not allowed")
        shape = spec.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40
                for d in shape):
            raise WireError("bad_shape", f"frame {k} field {name!r}: shape {shape!r}")
        count = 1
        for d in shape:
            count *= d
        if count * dtype.itemsize != view.nbytes:
            raise WireError("frame_size", f"frame {k} field {name!r}: {view.nbytes} bytes, "
                            f"shape {shape} of {dtype} needs {count * dtype.itemsize}")
        if name in arrays:
            raise WireError("bad_header", f"frame {k}: duplicate field {name!r}")
        arrays[name] = np.frombuffer(view, dtype=dtype).reshape(tuple(shape))
    missing = [n for n in (*CORE_FIELDS, "reward") if n not in arrays]
    if missing:
        raise WireError("invalid_field", f"field {missing[0]!r} missing "
                        f"(sample_id={sample_id[:64]!r})")
    for name, want in (*CORE_FIELDS.items(), ("reward", np.dtype(np.float32))):
        if arrays[name].dtype != want:
            raise WireError("bad_dtype", f"field {name!r}: dtype {arrays[name].dtype}, "
                            f"expected {want} (sample_id={sample_id[:64]!r})")
    unknown = [k for k in meta if k not in _META_KEYS]
    if unknown:
        raise WireError("bad_header", f"meta key {unknown[0]!r} not allowed")
    extras = {n: a for n, a in arrays.items() if n not in CORE_FIELDS and n != "reward"}
    try:
        traj = Trajectory(input_ids=arrays["input_ids"], loss_mask=arrays["loss_mask"],
                          logprobs=arrays["logprobs"], versions=arrays["versions"],
                          reward=arrays["reward"], sample_id=sample_id,
                          group_id=meta.get("group_id", ""),
                          prompt_len=meta.get("prompt_len", 0),
                          finish_reason=meta.get("finish_reason", ""),
                          created_at=meta.get("created_at", 0.0),
                          server_id=meta.get("server_id", ""), meta=meta.get("meta", {}),
                          token_extras=extras)
        if validate:
            traj.validate()
    except TrajectoryError as e:
        raise WireError("invalid_field", str(e)) from None
    return traj

"""Memory-bounded safetensors reading and writing, with errors that name the file.

:class:`SafetensorsDir` reads one tensor at a time with plain ``readinto`` (no mmap, so the
process never maps whole files), after checking that the index, every shard it names and every
shard's byte range are present. :class:`ShardedSafetensorsWriter` writes a standard
``model-0000i-of-0000N.safetensors`` set plus ``model.safetensors.index.json`` from a plan
(names, dtypes, shapes known up front), streaming each tensor's bytes into its shard as it
arrives, so only the tensor being written is in memory.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "SafetensorsError",
    "SafetensorsDir",
    "ShardedSafetensorsWriter",
    "DTYPES",
    "DTYPE_NAMES",
    "read_header",
    "split_row_name",
]

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsError(ValueError):
    """A missing, truncated or malformed safetensors file (the message names it)."""


def read_header(path: Path) -> Tuple[dict, int]:
    """Parse a safetensors header; returns ``(header, data_start)``. Checks that the file holds
    every byte the header promises."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: missing safetensors file") from None
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: truncated ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000 or 8 + n > size:
            raise SafetensorsError(
                f"{path}: truncated or corrupt header ({size} bytes, header claims {n})"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: corrupt header ({e})") from None
    data_start = 8 + n
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if data_start + end > size:
        raise SafetensorsError(
            f"{path}: truncated ({size} bytes, its header needs {data_start + end})"
        )
    return header, data_start


_ROW_NAME = re.compile(r"^(.+)\[(\d+)\]$")


def split_row_name(name: str) -> Optional[Tuple[str, int]]:
    """``"x[3]"`` (row 3, along dim 0, of tensor ``x``: one expert of a fused expert tensor)
    -> ``("x", 3)``; a plain tensor name -> None."""
    m = _ROW_NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


class SafetensorsDir:
    """The weights of an HF model directory, validated up front, read one tensor at a time.

    A name ``x[i]`` addresses row ``i`` of tensor ``x`` (GPT-OSS keeps each layer's experts
    in one tensor): only that row's bytes are read."""

    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise SafetensorsError(f"{index}: not a safetensors index ({e})") from None
            files = sorted(set(wmap.values()))
        elif (self.dir / SINGLE_NAME).is_file():
            files, wmap = [SINGLE_NAME], None
        else:
            extra = (
                ""
                if not list(self.dir.glob("*.bin"))
                else " (pytorch_model*.bin is not supported; re-save with safe_serialization=True)"
            )
            raise SafetensorsError(f"{self.dir}: no {INDEX_NAME} or {SINGLE_NAME}{extra}")
        self._where: Dict[str, Tuple[Path, dict, int]] = {}
        for fn in files:
            path = self.dir / fn
            header, start = read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if wmap is not None and wmap.get(name) not in (None, fn):
                    continue
                self._where[name] = (path, info, start)
        if wmap is not None:
            missing = [n for n, fn in wmap.items() if n not in self._where]
            if missing:
                raise SafetensorsError(
                    f"{self.dir / wmap[missing[0]]}: lacks tensor {missing[0]!r} listed in {index}"
                )

    def keys(self) -> List[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        try:
            self._lookup(name)
        except SafetensorsError:
            return False
        return True

    def info(self, name: str) -> Tuple[torch.dtype, Tuple[int, ...]]:
        """``(dtype, shape)`` of a tensor without reading it."""
        _, info, _ = self._lookup(name)
        return DTYPES[info["dtype"]], tuple(info["shape"])

    def _lookup(self, name):
        """``(file, header entry, data start)`` of ``name`` (a row name: the row's entry)."""
        if name in self._where:
            return self._where[name]
        parts = split_row_name(name)
        if parts and parts[0] in self._where:
            base, row = parts
            path, info, start = self._where[base]
            shape = info["shape"]
            if shape and row < shape[0]:
                b, e = info["data_offsets"]
                size = (e - b) // shape[0]
                sub = dict(
                    info, shape=shape[1:], data_offsets=[b + row * size, b + (row + 1) * size]
                )
                return path, sub, start
            raise SafetensorsError(f"{path}: tensor {base!r} of shape {shape} has no row {row}")
        raise SafetensorsError(f"{self.dir}: tensor {name!r} not found in the safetensors files")

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh tensor; nothing stays mapped)."""
        path, info, start = self._lookup(name)
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        b, e = info["data_offsets"]
        t = torch.empty(tuple(info["shape"]), dtype=DTYPES[info["dtype"]])
        if e - b != t.numel() * t.element_size():
            raise SafetensorsError(
                f"{path}: tensor {name!r} byte range does not match its shape {info['shape']}"
            )
        buf = t.view(-1).view(torch.uint8).numpy() if t.numel() else None
        with open(path, "rb") as f:
            f.seek(start + b)
            if buf is not None and f.readinto(buf) != e - b:
                raise SafetensorsError(f"{path}: truncated while reading {name!r}")
        return t


class ShardedSafetensorsWriter:
    """Write tensors, in a fixed planned order, into size-bounded safetensors shards.

    ``plan``: ``[(name, dtype, shape), ...]``. Call :meth:`write` once per tensor in plan
    order, then :meth:`close` (writes the index). Shards are named like ``transformers``
    names them; the index is always written."""

    def __init__(
        self,
        out_dir,
        plan: Sequence[Tuple[str, torch.dtype, Sequence[int]]],
        max_shard_bytes: int = 2 * 1024**3,
        metadata: Optional[dict] = None,
    ):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        shards: List[List[Tuple[str, torch.dtype, Tuple[int, ...], int]]] = [[]]
        used = 0
        for name, dtype, shape in plan:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            if shards[-1] and used + nbytes > max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append((name, dtype, tuple(shape), nbytes))
            used += nbytes
        n = len(shards)
        self._order: List[Tuple[str, int, Tuple[int, ...], torch.dtype]] = []
        self._files: List[str] = []
        self._headers: List[bytes] = []
        self.weight_map: Dict[str, str] = {}
        self.total_bytes = 0
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            self._files.append(fn)
            header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
            off = 0
            for name, dtype, shape, nbytes in shard:
                header[name] = {
                    "dtype": DTYPE_NAMES[dtype],
                    "shape": list(shape),
                    "data_offsets": [off, off + nbytes],
                }
                off += nbytes
                self._order.append((name, i, shape, dtype))
                self.weight_map[name] = fn
            self.total_bytes += off
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            self._headers.append(raw)
        self._next = 0
        self._fh = None
        self._fh_idx = -1

    def write(self, name: str, t) -> None:
        """Append the next planned tensor (must match the plan's name, dtype and shape).

        ``t`` is a tensor or a list of row blocks whose concatenation (dim 0) is the tensor
        (written one after the other, never concatenated in memory)."""
        if self._next >= len(self._order):
            raise RuntimeError(f"{name}: more tensors than planned")
        pname, idx, shape, dtype = self._order[self._next]
        segs = list(t) if isinstance(t, (list, tuple)) else [t]
        rows = sum(s.shape[0] if s.dim() else 1 for s in segs)
        got = (rows,) + tuple(segs[0].shape[1:]) if segs[0].dim() else tuple(segs[0].shape)
        if name != pname or got != shape or any(s.dtype != dtype for s in segs):
            raise RuntimeError(
                f"out-of-plan tensor {name} {got} {segs[0].dtype}; expected {pname} {shape} {dtype}"
            )
        if idx != self._fh_idx:
            self._finish_file()
            self._fh = open(self.out / self._files[idx], "wb")
            self._fh_idx = idx
            self._fh.write(struct.pack("<Q", len(self._headers[idx])))
            self._fh.write(self._headers[idx])
        for s in segs:
            s = s.detach().cpu().contiguous()
            if s.numel():
                self._fh.write(s.reshape(-1).view(torch.uint8).numpy())
        self._next += 1

    def _finish_file(self):
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def close(self) -> Path:
        """Finish the last shard and write the index; returns the index path."""
        if self._next != len(self._order):
            missing = self._order[self._next][0]
            raise RuntimeError(
                f"{self.out}: only {self._next}/{len(self._order)} tensors "
                f"written (next expected {missing})"
            )
        self._finish_file()
        index = self.out / INDEX_NAME
        index.write_text(
            json.dumps(
                {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map},
                indent=2,
            )
            + "\n"
        )
        return index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            self._finish_file()

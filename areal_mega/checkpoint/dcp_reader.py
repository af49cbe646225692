"""Read any region of a tensor from a ``torch_dist`` (torch DCP) checkpoint, chunk by chunk.

``dist_checkpointing.load`` wants every shard of a key in one call (in one process it cannot
load, say, one layer of a stacked tensor), so the offline HF exporter reads regions itself from
the DCP metadata: for every saved chunk overlapping the region, the chunk's bytes (a
``torch.save`` zip record, uncompressed) are read straight into the destination when the
overlap is the whole chunk and the destination slice is contiguous; otherwise the chunk is
loaded and its overlapping part copied. Memory: the region plus at most one chunk.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path
from typing import Dict, Sequence, Tuple

import torch

__all__ = ["DcpReader"]


class _Window(io.RawIOBase):
    """A read-only file-like view of ``[base, base + length)`` of an open file."""

    def __init__(self, f, base: int, length: int):
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, off, whence=0):
        self.pos = {0: off, 1: self.pos + off, 2: self.length + off}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.base + self.pos)
        b = self.f.read(n)
        self.pos += len(b)
        return b


class DcpReader:
    """Tensor regions of one checkpoint directory (metadata read once)."""

    def __init__(self, path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        md = FileSystemReader(str(self.path)).read_metadata()
        self.meta = md.state_dict_metadata
        self._storage: Dict[Tuple[str, Tuple[int, ...]], object] = {
            (idx.fqn, tuple(idx.offset)): info
            for idx, info in md.storage_data.items()
            if idx.offset is not None
        }

    def size(self, key: str) -> Tuple[int, ...]:
        return tuple(self.meta[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.meta[key].properties.dtype

    def read(
        self, key: str, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype = None
    ) -> torch.Tensor:
        """The region ``[offsets, offsets + sizes)`` of the global tensor ``key``."""
        if key not in self.meta:
            raise KeyError(f"{self.path}: tensor {key!r} is not in the checkpoint")
        md = self.meta[key]
        out = torch.empty(tuple(sizes), dtype=md.properties.dtype)
        covered = 0
        for ch in md.chunks:
            c_off, c_size = tuple(ch.offsets), tuple(ch.sizes)
            lo = [max(a, b) for a, b in zip(offsets, c_off)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, c_off, c_size)]
            if any(end <= start for start, end in zip(lo, hi)):
                continue
            dst = out[tuple(slice(start - o, end - o) for start, end, o in zip(lo, hi, offsets))]
            whole = lo == list(c_off) and hi == [b + t for b, t in zip(c_off, c_size)]
            if not (whole and dst.is_contiguous() and self._read_raw(key, c_off, dst)):
                chunk = self._load_chunk(key, c_off)
                dst.copy_(
                    chunk[tuple(slice(start - b, end - b) for start, end, b in zip(lo, hi, c_off))]
                )
                del chunk
            covered += dst.numel()
        if covered != out.numel():
            raise KeyError(
                f"{self.path}: tensor {key!r} region {tuple(offsets)}+{tuple(sizes)} "
                f"is not fully stored in the checkpoint"
            )
        return out if dtype is None else out.to(dtype)

    def _info(self, key, c_off):
        info = self._storage.get((key, c_off))
        if info is None:
            raise KeyError(f"{self.path}: no storage entry for {key!r} chunk at {c_off}")
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(f"{self.path}: transformed (compressed) DCP chunks")
        return info

    def _load_chunk(self, key, c_off) -> torch.Tensor:
        info = self._info(key, c_off)
        with open(self.path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if len(raw) != info.length:
            raise OSError(f"{self.path / info.relative_path}: truncated reading {key!r}")
        return torch.load(io.BytesIO(raw), weights_only=True)

    def _read_raw(self, key, c_off, dst: torch.Tensor) -> bool:
        """Read a chunk's storage bytes straight into ``dst``; False if the record is not a
        plain, exactly sized, uncompressed storage (then the caller falls back)."""
        info = self._info(key, c_off)
        nbytes = dst.numel() * dst.element_size()
        with open(self.path / info.relative_path, "rb") as f:
            try:
                with zipfile.ZipFile(_Window(f, info.offset, info.length)) as zf:
                    recs = [i for i in zf.infolist() if "/data/" in i.filename]
                    if (
                        len(recs) != 1
                        or recs[0].compress_type != zipfile.ZIP_STORED
                        or recs[0].file_size != nbytes
                    ):
                        return False
                    hdr = recs[0].header_offset
            except zipfile.BadZipFile:
                return False
            f.seek(info.offset + hdr)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            f.seek(info.offset + hdr + 30 + name_len + extra_len)
            if nbytes and f.readinto(dst.view(-1).view(torch.uint8).numpy()) != nbytes:
                raise OSError(f"{self.path / info.relative_path}: truncated reading {key!r}")
        return True

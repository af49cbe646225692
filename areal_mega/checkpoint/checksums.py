"""Content checksums of checkpoint files (torch-free): what :mod:`.dist_ckpt` writes into
``areal_meta.json`` at save and checks at load and in the converters.

``areal_meta.json`` gets a ``"checksums"`` entry::

    {"algorithm": "crc32",
     "files": {"__0_0.distcp": {"size": 202318, "crc32": "5f0c2a1e"}, "hf/config.json": ...},
     "meta_crc32": "..."}        # of areal_meta.json itself, without this one field

Every file of the checkpoint directory except ``areal_meta.json`` is listed. The hash is
zlib's CRC-32: the threat is accidental corruption (bit rot, a torn or truncated copy, a bad
disk), not tampering (no unkeyed checksum stored next to the data would stop that), and CRC-32
finds every burst of up to 32 flipped bits and misses a random corruption with probability
2**-32 per file, at several GB/s (7x SHA-256 and 8x BLAKE2b on our hosts; see
docs/reliability.md). Sizes are recorded too, so truncation is reported as such.

At save each rank hashes the torch DCP files it wrote itself (``__<rank>_<i>.distcp``, still in
its page cache), in parallel; rank 0 hashes the rest (``.metadata``, ``metadata.json``,
``hf/*``; ``common.pt`` in checkpoints of megatron-core < 0.19) and merges. At load every rank
hashes a balanced share of the
files and the ranks agree on the outcome.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from areal_mega.run_dir import META_NAME

ALGORITHM = "crc32"
CHUNK = 1 << 20  # as fast as 8 MiB (the GIL-free CRC dominates), and a small memory footprint
_WRITER_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def file_crc32(path) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (read in 1 MiB chunks, no whole-file copy)."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def list_files(ckpt) -> List[str]:
    """Every file under checkpoint directory ``ckpt`` but ``areal_meta.json``, as sorted
    POSIX paths relative to it."""
    ckpt = Path(ckpt)
    out = []
    for dirpath, _, files in os.walk(ckpt):
        for fn in files:
            rel = (Path(dirpath) / fn).relative_to(ckpt).as_posix()
            if rel != META_NAME:
                out.append(rel)
    return sorted(out)


def writer_rank(rel: str) -> Optional[int]:
    """The rank that wrote torch DCP file ``__<rank>_<i>.distcp``; None for any other file."""
    m = _WRITER_RE.match(rel)
    return int(m.group(1)) if m else None


def save_share(files: Iterable[str], rank: int, world: int) -> List[str]:
    """The files ``rank`` hashes at save: the DCP files it wrote; rank 0 also every other file
    (so each file is hashed exactly once)."""
    out = []
    for rel in files:
        w = writer_rank(rel)
        if w == rank or (rank == 0 and (w is None or w >= world)):
            out.append(rel)
    return out


def load_share(files: Dict[str, dict], rank: int, world: int) -> List[str]:
    """The files ``rank`` checks at load: largest first, each to the least-loaded rank, so
    every file is read once by one rank and the ranks read about the same number of bytes."""
    load = [0] * world
    mine = []
    for rel in sorted(files, key=lambda r: (-int(files[r].get("size", 0)), r)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += int(files[rel].get("size", 0)) + 1
        if r == rank:
            mine.append(rel)
    return mine


def hash_files(ckpt, rels: Iterable[str], threads: int = 4) -> Dict[str, dict]:
    """``{rel: {"size": bytes, "crc32": hex}}`` for files ``rels`` under ``ckpt`` (hashed in a
    few threads: zlib releases the GIL)."""
    ckpt = Path(ckpt)
    rels = list(rels)

    def one(rel):
        p = ckpt / rel
        return rel, {"size": p.stat().st_size, ALGORITHM: file_crc32(p)}

    if len(rels) <= 1:
        return dict(map(one, rels))
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(rels)))) as pool:
        return dict(pool.map(one, rels))


def meta_digest(meta: dict) -> str:
    """CRC-32 of ``meta`` (parsed ``areal_meta.json``) in canonical JSON, without the digest
    itself, so a flipped byte in the metadata (step, manifest) is caught as well."""
    m = dict(meta)
    cs = dict(m.get("checksums") or {})
    cs.pop("meta_crc32", None)
    m["checksums"] = cs
    text = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{zlib.crc32(text.encode()):08x}"


def seal(meta: dict, files: Dict[str, dict]) -> dict:
    """``meta`` normalised through JSON, with the ``checksums`` entry for ``files`` and its own
    digest: exactly what is written to ``areal_meta.json``."""
    m = json.loads(json.dumps(meta, default=str))
    m["checksums"] = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    m["checksums"]["meta_crc32"] = meta_digest(m)
    return m


def check_files(ckpt, files: Dict[str, dict], rels: Iterable[str]) -> List[str]:
    """Compare files ``rels`` under ``ckpt`` with the manifest ``files``; one message per bad
    file, naming it (missing, wrong size, or content checksum mismatch)."""
    ckpt = Path(ckpt)
    errors = []
    for rel in rels:
        want, p = files[rel], ckpt / rel
        kind = "shard" if rel.endswith(".distcp") else "file"
        if not p.is_file():
            errors.append(f"{p}: missing checkpoint {kind} (listed in {ckpt / META_NAME})")
            continue
        try:
            size = p.stat().st_size
            got = file_crc32(p) if size == want.get("size") else None
        except OSError as e:
            errors.append(f"{p}: unreadable ({e})")
            continue
        if size != want.get("size"):
            what = f"truncated checkpoint {kind}" if size < want.get("size", 0) else "wrong size"
            errors.append(f"{p}: {what} ({size} bytes, the checkpoint recorded {want.get('size')})")
            continue
        if got != want.get(ALGORITHM):
            errors.append(
                f"{p}: content checksum mismatch ({ALGORITHM} {got}, recorded "
                f"{want.get(ALGORITHM)}): the file is corrupt"
            )
    return errors

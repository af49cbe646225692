"""Checking a checkpoint before anything trusts it: completeness, sizes and content checksums
(:mod:`.checksums`), on one process or split over the ranks of a collective load.

Torch is imported lazily, only to read torch DCP's ``.metadata``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict

from areal_mega.checkpoint import checksums as cks
from areal_mega.run_dir import META_NAME

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "verify_checkpoint"]


class CheckpointError(RuntimeError):
    """A missing, incomplete, corrupt or unreadable checkpoint (the message names the file)."""


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def read_meta(path: Path) -> Dict[str, Any]:
    """The parsed ``areal_meta.json`` of checkpoint ``path``, which must say it is complete
    (no file checks); raises :class:`CheckpointError` naming the file."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    meta_path = path / META_NAME
    if not meta_path.is_file():
        raise CheckpointError(
            f"{meta_path}: missing; {path} is not a complete checkpoint (interrupted save?)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from None
    if not isinstance(meta, dict) or not meta.get("complete"):
        raise CheckpointError(f"{meta_path}: checkpoint not marked complete")
    return meta


def verify_share(path, rank: int = 0, world: int = 1) -> Dict[str, Any]:
    """:func:`verify_checkpoint`, hashing only the share of the files that ``rank`` of
    ``world`` checks (:func:`~areal_mega.checkpoint.checksums.load_share`)."""
    path = Path(path)
    meta = read_meta(path)
    sums = meta.get("checksums")
    if sums is None:
        if rank == 0:
            logger.warning(
                "%s: written without content checksums (before they existed); "
                "checking file sizes only",
                path / META_NAME,
            )
    elif (
        not isinstance(sums, dict)
        or sums.get("algorithm") != cks.ALGORITHM
        or sums.get("meta_crc32") != cks.meta_digest(meta)
    ):
        raise CheckpointError(
            f"{path / META_NAME}: content checksum mismatch (or unknown "
            f"checksum algorithm): the metadata file is corrupt"
        )
    files = (sums or {}).get("files", {})
    bad = cks.check_files(path, files, cks.load_share(files, rank, world))
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError("; ".join(bad[:3]) + more)
    # megatron-core >= 0.19 keeps the common (non-tensor) state inside the DCP files; a
    # ``common.pt`` exists only in checkpoints written by older releases (still loadable)
    megatron_files = ["metadata.json", ".metadata"] + (
        ["common.pt"] if (path / "common.pt").is_file() else []
    )
    for fn in megatron_files:
        if not (path / fn).is_file():
            raise CheckpointError(f"{path / fn}: missing megatron checkpoint file")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unpickling problem means a broken file
        raise CheckpointError(
            f"{path / '.metadata'}: unreadable ({type(e).__name__}: {e})"
        ) from None
    need: Dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel in megatron_files + sorted(need):
        if sums is not None and rel not in files:
            raise CheckpointError(
                f"{path / rel}: not covered by the checksums in {path / META_NAME}"
            )
    for rel, n in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f}: missing checkpoint shard")
        size = f.stat().st_size
        if size < n:
            raise CheckpointError(f"{f}: truncated checkpoint shard ({size} bytes, needs {n})")
    return meta


def verify_checkpoint(path) -> Dict[str, Any]:
    """Check one checkpoint directory: ``areal_meta.json`` says it is complete and matches its
    own checksum, every file matches the size and CRC-32 recorded at save, megatron's files
    exist and every ``.distcp`` file holds every byte the torch DCP metadata points at.
    A checkpoint from before checksums existed is checked by sizes only, with a warning.
    Returns the parsed ``areal_meta.json``; raises :class:`CheckpointError` naming the file."""
    return verify_share(path)


def gather_all(obj) -> list:
    """``obj`` of every rank (all_gather_object; ``[obj]`` without a process group)."""
    d = _dist()
    if d is None or d.get_world_size() == 1:
        return [obj]
    out: list = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def verify_collective(path: Path) -> Dict[str, Any]:
    """:func:`verify_checkpoint` split over the ranks (each file read by one rank); every rank
    raises the same :class:`CheckpointError` when any rank found a problem. Collective."""
    world = _dist().get_world_size() if _dist() else 1
    try:
        meta, err = verify_share(path, _rank(), world), None
    except CheckpointError as e:
        meta, err = None, str(e)
    errors = [e for e in gather_all(err) if e]
    if errors:
        raise CheckpointError(
            errors[0] if len(errors) == 1 else f"{errors[0]} (and {len(errors) - 1} more problems)"
        )
    return meta

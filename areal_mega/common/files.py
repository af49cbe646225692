"""Atomic file writes: a reader sees the old content or the new one, never a part of it.

The data goes to a temporary file in the target's directory (same filesystem, so the rename
is atomic), which then replaces the target with ``os.replace``. If writing fails the
temporary file is removed and the target keeps its old content.

``durable`` is a required choice at every call site:

* ``durable=True`` also fsyncs the file before the rename and the directory after it, so the
  new content survives a machine crash (power loss, kernel panic), not only a crash of the
  process. For what a restart reads back: journals, checkpoint pointers, buffer snapshots,
  run files and secrets.
* ``durable=False`` is atomic for other processes, but after a machine crash the file may
  hold the old content (on some filesystems even nothing). For outputs a person regenerates.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import IO, Iterator, Optional, Union

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def fsync_path(path: Union[str, os.PathLike]) -> None:
    """fsync a file or a directory by path (a directory's fsync makes the renames and new
    entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(path: Path, file_mode: Optional[int]) -> tuple[int, Path]:
    # O_EXCL on a random name: concurrent writers of one target never share a temp file
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            # without file_mode, 0o666 minus the umask, like open(); with it, never more than
            # file_mode from the first moment
            fd = os.open(tmp, _CREATE, 0o666 if file_mode is None else file_mode)
            break
        except FileExistsError:
            continue
    if file_mode is not None:
        try:
            os.fchmod(fd, file_mode)  # exactly file_mode whatever the umask, before any byte
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
    return fd, tmp


@contextlib.contextmanager
def atomic_open(
    path: Union[str, os.PathLike],
    mode: str = "wb",
    *,
    durable: bool,
    file_mode: Optional[int] = None,
) -> Iterator[IO]:
    """A file to write ``path``'s new content into (``mode`` ``"wb"`` or ``"w"``, UTF-8): when
    the ``with`` block ends normally it replaces ``path``; when it raises, ``path`` keeps its
    old content and no temporary file remains. ``durable``: fsync the file and the directory
    (see the module docstring). ``file_mode`` (e.g. ``0o600``): the file's exact permissions,
    set before anything is written; ``None`` follows the umask like ``open``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode={mode!r}: atomic_open writes a whole file, use 'w' or 'wb'")
    path = Path(path)
    fd, tmp = _create_temp(path, file_mode)
    try:
        f = os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        with f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_path(path.parent)


def atomic_write(
    path: Union[str, os.PathLike],
    data: Union[bytes, str],
    *,
    durable: bool,
    mode: Optional[int] = None,
) -> Path:
    """Replace ``path``'s content with ``data`` (``str`` is written as UTF-8) atomically; see
    :func:`atomic_open` for ``durable`` and ``mode`` (the file's permissions). Returns the
    path."""
    with atomic_open(
        path, "wb" if isinstance(data, bytes) else "w", durable=durable, file_mode=mode
    ) as f:
        f.write(data)
    return Path(path)

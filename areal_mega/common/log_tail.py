"""The error a dead process left in its log, for one-line death notices (supervisor, servers)."""

from __future__ import annotations

import os
import re
from typing import BinaryIO, Union

_ERROR_LINE = re.compile(
    r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)"
    r"|Killed|Segmentation fault)\b.*"
)
_BOILERPLATE = ("ChildFailedError",)  # torchrun's wrapper; the rank's own error comes first
_TAIL_BYTES = 64 * 1024


def last_error_line(text: str, max_chars: int = 400) -> str:
    """The last exception line of ``text`` (``ValueError: ...``, also with torchrun's
    ``[rankN]:`` prefix), skipping torchrun's ``ChildFailedError`` wrapper; ``""`` if none."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if _ERROR_LINE.match(line) and not any(b in line for b in _BOILERPLATE):
            return line if len(line) <= max_chars else line[: max_chars - 3] + "..."
    return ""


def last_error(log: Union[str, os.PathLike, BinaryIO]) -> str:
    """``"\\n  last error: <line>"`` for :func:`last_error_line` of the last 64 KiB of
    ``log`` (a path, or a binary file open for reading); ``""`` when it is unreadable or
    holds no error."""
    try:
        if isinstance(log, (str, os.PathLike)):
            with open(log, "rb") as f:
                return last_error(f)
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - _TAIL_BYTES))
        text = log.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""
    line = last_error_line(text)
    return f"\n  last error: {line}" if line else ""

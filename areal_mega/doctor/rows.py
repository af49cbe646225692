"""The doctor's machinery: a check, the row it produces, the shared context, the runner and the
final table.

A check is a function ``fn(ctx) -> str`` returning its key figure; it raises
:class:`CheckFailed` (what is wrong and what to do) or :class:`CheckSkipped` (why it does not
apply here). Any other exception is a failure too, reported with the check's own advice.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

#: the repository (or install) root: the directory holding the ``areal_mega`` package
ROOT = Path(__file__).resolve().parents[2]


class CheckFailed(RuntimeError):
    """A check found a problem: ``str(self)`` says what, ``fix`` what to do (default: the
    check's own advice)."""

    def __init__(self, message: str, fix: Optional[str] = None):
        super().__init__(message)
        self.fix = fix


class CheckSkipped(RuntimeError):
    """The check does not apply on this machine (``str(self)`` says why)."""


@dataclass
class Check:
    """One row of the doctor: ``name``, what it verifies (``what``), the default advice on
    failure (``fix``), the function, the checks whose results it needs (``needs``: skipped
    when one of them did not pass) and whether it runs only with CUDA (``cuda``)."""

    name: str
    what: str
    fix: str
    fn: Callable[["Context"], str]
    needs: tuple = ()
    cuda: bool = False


@dataclass
class Row:
    """The result of one check: ``status`` is ``pass``, ``fail`` or ``skip``."""

    name: str
    what: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "what": self.what,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
            "seconds": round(self.seconds, 2),
        }


@dataclass
class Context:
    """What the checks share: a work directory, the python and package root the subprocesses
    use, and state one check leaves for the next (``state``: the tiny model, the server, the
    RL run's metrics). ``server_addr``: check this running CPU rollout server (serving
    ``model_dir``) instead of starting one."""

    work: Path
    root: Path = ROOT
    python: str = sys.executable
    model_dir: Optional[Path] = None
    server_addr: Optional[str] = None
    state: Dict[str, object] = field(default_factory=dict)
    cleanups: List[Callable[[], None]] = field(default_factory=list)

    def env(self, **extra: str) -> dict:
        """The environment of a subprocess: this package first on ``PYTHONPATH``."""
        path = os.environ.get("PYTHONPATH", "")
        return dict(
            os.environ,
            PYTHONPATH=str(self.root) + (os.pathsep + path if path else ""),
            PYTHONUNBUFFERED="1",
            **extra,
        )

    def close(self) -> None:
        """Run the cleanups (stop the server the checks started), newest first."""
        while self.cleanups:
            try:
                self.cleanups.pop()()
            except Exception:  # noqa: BLE001 - cleanup must not hide the table
                pass


def new_context(work: Optional[str] = None, **kw) -> Context:
    """A :class:`Context` on ``work`` (default: a fresh temporary directory)."""
    path = Path(work) if work else Path(tempfile.mkdtemp(prefix="areal-doctor-"))
    path.mkdir(parents=True, exist_ok=True)
    return Context(work=path.resolve(), **kw)


def run_check(check: Check, ctx: Context, done: Dict[str, Row]) -> Row:
    """Run one check (never raises) and return its row."""
    missing = [n for n in check.needs if n in done and done[n].status != "pass"]
    if missing:
        return Row(check.name, check.what, "skip", f"needs {', '.join(missing)} to pass")
    t0 = time.monotonic()
    try:
        detail, status, fix = check.fn(ctx), "pass", ""
    except CheckSkipped as e:
        detail, status, fix = str(e), "skip", ""
    except CheckFailed as e:
        detail, status, fix = str(e), "fail", e.fix or check.fix
    except Exception as e:  # noqa: BLE001 - one check's crash must not hide the others
        last = traceback.extract_tb(e.__traceback__)[-1]
        detail = f"{type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})"
        status, fix = "fail", check.fix
    return Row(check.name, check.what, status, detail, fix, time.monotonic() - t0)


def run_checks(
    checks: Sequence[Check], ctx: Context, *, cuda: bool = False, progress=None
) -> List[Row]:
    """Run ``checks`` in order (CUDA-only ones only when ``cuda``); ``progress(line)`` gets a
    line before and after each. Stops nothing on failure; closes ``ctx`` at the end."""
    say = progress or (lambda line: None)
    chosen = [c for c in checks if cuda or not c.cuda]
    done: Dict[str, Row] = {}
    try:
        for i, check in enumerate(chosen, 1):
            say(f"[doctor] {i}/{len(chosen)} {check.name}: {check.what} ...")
            row = run_check(check, ctx, done)
            done[check.name] = row
            say(
                f"[doctor] {i}/{len(chosen)} {check.name}: {row.status.upper()} "
                f"({row.seconds:.1f} s) {row.detail}"
            )
    finally:
        ctx.close()
    return list(done.values())


def format_table(rows: Sequence[Row]) -> str:
    """The final table: one line per row, then the advice of every failed row."""
    head = ("check", "result", "s", "detail")
    lines = [(r.name, r.status.upper(), f"{r.seconds:.1f}", r.detail) for r in rows]
    w = [max(len(x[i]) for x in [head, *lines]) for i in range(3)]
    out = [f"{x[0]:<{w[0]}}  {x[1]:<{w[1]}}  {x[2]:>{w[2]}}  {x[3]}" for x in [head, *lines]]
    out.insert(1, "-" * min(100, max(len(s) for s in out)))
    fails = [r for r in rows if r.status == "fail"]
    if fails:
        out.append("")
        out += [f"to fix {r.name}: {r.fix}" for r in fails]
    return "\n".join(out)

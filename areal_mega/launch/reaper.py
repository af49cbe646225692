"""Stop a process tree once the process that started it is gone (``launch.ray``).

    python -m areal_mega.launch.reaper [--detach] PARENT_PID CHILD_PID GRACE_S

A Ray actor that dies with its node (or with ``ray stop``) ends without running any code of
ours: its child gets SIGTERM (``PR_SET_PDEATHSIG``), but the child's own children (torchrun's
ranks, each in a session of its own) would be left behind. The actor starts this watcher in a
session of its own: while the actor lives it records the child's descendants; once the actor
is gone it stops all of them (SIGTERM, SIGKILL after ``GRACE_S``). It exits by itself when the
child ends while the actor lives (the actor then stops what is left, as the supervisor does).
``--detach`` forks it off (the command returns at once): a Ray worker that exits kills its own
children (``RAY_kill_child_processes_on_worker_exit``), torchrun among them, which leaves the
ranks; a watcher that were its child would go with them.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import psutil

POLL_S = 0.5


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch(parent_pid: int, child_pid: int, grace_s: float, poll_s: float = POLL_S) -> int:
    """Watch until the child ends (0) or the parent dies (then stop the tree; 1)."""
    try:
        parent, child = psutil.Process(parent_pid), psutil.Process(child_pid)
    except psutil.Error:
        return 0
    known = {child}
    while _alive(parent):
        if not _alive(child):
            return 0
        try:
            known |= set(child.children(recursive=True))
        except psutil.Error:
            pass
        time.sleep(poll_s)
    live = [p for p in known if _alive(p)]
    for p in live:
        try:  # psutil checks the process's start time: a reused pid is not signalled
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(live, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    return 1


def main(argv: Optional[list] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    detach = args[:1] == ["--detach"]
    args = args[1:] if detach else args
    if len(args) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if detach and os.fork() > 0:
        os._exit(0)  # the caller reaps this; the watcher goes on, a child of init
    return watch(int(args[0]), int(args[1]), float(args[2]))


if __name__ == "__main__":
    sys.exit(main())

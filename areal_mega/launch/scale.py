"""Add or remove rollout servers of a running job (elastic rollout).

    python -m areal_mega.launch.scale --run-dir RUN --list
    python -m areal_mega.launch.scale --run-dir RUN --add N            # N local servers
    python -m areal_mega.launch.scale --run-dir RUN --add-addr HOST:PORT   # an external one
    python -m areal_mega.launch.scale --run-dir RUN --remove SERVER_ID [--drain]

Talks to the job's ``launch.local`` (its control socket in the run directory, see
:mod:`areal_mega.launch.elastic`), which starts / stops the servers it owns and has the rollout
worker bring a joining server to the current weights before it gets a request. ``--drain``
lets a leaving server finish its requests; without it they are interrupted and resumed on
another server from their partial output. ``--list`` answers at once, whatever else is in
progress, with the operations in progress. A mutating command is queued behind the ones
before it and must finish within ``--timeout`` seconds (its own deadline, enforced by the
launcher; the error says what was left). Prints the launcher's JSON answer; exit code 0 on
success, 1 when the request was refused or failed (the message says what changed), 2 for bad
arguments. With ``dataplane.secret`` set for the job, pass it in ``AREAL_MEGA_SECRET``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from areal_mega.dataplane.control import ControlError, ControlTimeout, RolloutLink
from areal_mega.run_dir import RunDir

log = logging.getLogger(__name__)


def request_of(args: argparse.Namespace) -> dict:
    """The launcher command for parsed CLI arguments (pure)."""
    if args.list:
        return {"cmd": "list"}
    if args.add is not None:
        return {"cmd": "add", "n": args.add}
    if args.add_addr is not None:
        return {"cmd": "add_addr", "addr": args.add_addr}
    return {"cmd": "remove", "id": args.remove, "drain": bool(args.drain)}


LIST_TIMEOUT_S = 30.0
"""How long ``--list`` waits for the launcher (which answers within a second)."""


def run_command(
    link: RolloutLink,
    msg: dict,
    timeout_s: float,
    poll_s: float = 0.2,
    answer_timeout_s: float = LIST_TIMEOUT_S,
) -> dict:
    """Send one command; a read answers at once, a mutating command is queued as an operation
    (with ``timeout_s`` as its deadline) that this polls until it ends. Returns the reply or
    the operation's result; :class:`ControlError` when refused, failed or out of time.

    A poll the launcher leaves unanswered for ``answer_timeout_s`` (a launcher starved of CPU,
    or one whose socket dropped the connection) is sent again until the operation's own
    deadline has passed: the operation runs on in the launcher either way, and giving up on
    the first silent poll would report a failure for an operation that then succeeds."""
    if msg["cmd"] == "list":
        return link.request(msg, timeout_s=answer_timeout_s)
    # an id of its own: a resend after a dropped socket is answered, not run twice
    op = link.request(
        {**msg, "timeout_s": timeout_s, "request_id": uuid.uuid4().hex},
        timeout_s=answer_timeout_s,
    )
    deadline = time.monotonic() + timeout_s + answer_timeout_s
    unanswered: Optional[ControlTimeout] = None  # the last poll, when it went unanswered
    while op["state"] not in ("done", "failed"):
        if time.monotonic() > deadline:
            if unanswered is not None:  # the launcher's silence is the reason, not the op's
                raise unanswered
            raise ControlError(
                f"{msg['cmd']}: operation {op['op']} still {op['state']!r} "
                f"after {timeout_s:.0f} s (--timeout)"
            )
        time.sleep(poll_s)
        left = deadline - time.monotonic()
        try:
            op = link.request(
                {"cmd": "op", "op": op["op"]}, timeout_s=max(0.1, min(answer_timeout_s, left))
            )
            unanswered = None
        except ControlTimeout as e:
            if time.monotonic() >= deadline:
                raise
            unanswered = e
            log.warning("%s; asking again (operation %s)", e, op["op"])
    if op["state"] == "failed":
        raise ControlError(op.get("error") or "failed")
    return op.get("result") or {}


def main(argv: Optional[list] = None) -> int:
    """CLI entry point; see the module docstring."""
    p = argparse.ArgumentParser(
        prog="python -m areal_mega.launch.scale", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--run-dir", required=True, help="logging.run_dir of the running job")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true", help="the servers and their counters")
    g.add_argument("--add", type=int, metavar="N", help="start N local servers")
    g.add_argument("--add-addr", metavar="HOST:PORT", help="attach an external SGLang server")
    g.add_argument("--remove", metavar="SERVER_ID", help="remove a server (ids: --list)")
    p.add_argument(
        "--drain", action="store_true", help="with --remove: let its in-flight requests finish"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds a mutating command may take (the launcher stops it then)",
    )
    args = p.parse_args(argv)
    if args.drain and args.remove is None:
        p.error("--drain goes with --remove")
    if args.add is not None and args.add < 1:
        p.error(f"--add {args.add}: must be >= 1")
    if not args.timeout > 0:
        p.error(f"--timeout {args.timeout}: must be > 0")
    run_dir = Path(args.run_dir).resolve()
    if not (run_dir / "config.yaml").is_file():
        print(
            f"error: {run_dir} is not the run directory of a launch.local job (no config.yaml)",
            file=sys.stderr,
        )
        return 2
    endpoint = RunDir(run_dir, run_dir, "", "").launcher_endpoint
    if not Path(endpoint.removeprefix("ipc://")).exists():
        print(
            f"error: no launcher is running for {run_dir} ({endpoint} does not exist)",
            file=sys.stderr,
        )
        return 1
    link = RolloutLink(
        endpoint,
        secret=os.environ.get("AREAL_MEGA_SECRET") or None,
        timeout_s=LIST_TIMEOUT_S,
        peer="launcher",
    )
    try:
        reply = run_command(link, request_of(args), args.timeout)
    except ControlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        link.close()
    reply.pop("ok", None)
    print(json.dumps(reply, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

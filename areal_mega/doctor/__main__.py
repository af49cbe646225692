"""``python -m areal_mega.doctor [--json] [--json-out FILE] [--only a,b] [--work DIR] [--list]``:
run the checks,
print a progress line per row and the final table; exit 1 when any row failed."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import warnings

from areal_mega.doctor import CHECKS, format_table, new_context, run_checks, select_checks


def main(argv=None) -> int:
    """Run the doctor; returns the exit status (0: no row failed)."""
    p = argparse.ArgumentParser(
        prog="python -m areal_mega.doctor",
        description="Check this machine for areal-mega, by numbers.",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the rows as JSON on stdout (progress goes to stderr)",
    )
    p.add_argument("--json-out", default=None, help="also write the JSON report to this file")
    p.add_argument("--only", default=None, help="comma-separated checks (and what they need)")
    p.add_argument(
        "--work",
        default=None,
        help="work directory, kept (default: a temporary one, removed unless a check failed)",
    )
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    args = p.parse_args(argv)
    if args.list:
        for c in CHECKS:
            print(f"{c.name:18s} {'(CUDA) ' if c.cuda else ''}{c.what}")
        return 0
    try:
        checks = select_checks(args.only.split(",") if args.only else None)
    except ValueError as e:
        p.error(str(e))
    # megatron-core's notices (no TE/apex fallbacks, deprecations) and transformers' progress
    # bars are not findings; they would only break up the rows
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    cuda = False
    try:  # a missing or broken torch / transformers is the packages row's finding
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        pass
    out = sys.stderr if args.json else sys.stdout
    ctx = new_context(args.work)
    t0 = time.monotonic()
    rows = run_checks(checks, ctx, cuda=cuda, progress=lambda s: print(s, file=out, flush=True))
    seconds = time.monotonic() - t0
    ok = not any(r.status == "fail" for r in rows)
    report = {
        "ok": ok,
        "seconds": round(seconds, 1),
        "cuda": cuda,
        "work": str(ctx.work),
        "rows": [r.as_dict() for r in rows],
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print("\n" + format_table(rows))
        print(
            f"\n{'all checks passed' if ok else 'FAILED'} in {seconds:.0f} s"
            + (f"; work directory {ctx.work}" if args.work or not ok else "")
        )
    if ok and not args.work:
        shutil.rmtree(ctx.work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

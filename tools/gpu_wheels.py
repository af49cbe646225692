"""Download our dependencies as wheels for an offline CUDA box (``make gpu-wheels``).

    python tools/gpu_wheels.py [--dest .whl] [--python-version 3.12] [-r requirements.txt]

Run on a machine with internet. Takes ``requirements.txt`` minus torch (the GPU box has its
CUDA torch) and everything torch brings (``nvidia-*``, ``triton``), and downloads wheels for
CPython ``--python-version`` on manylinux x86_64, following each wheel's ``Requires-Dist``
(markers evaluated for that target) breadth-first with ``pip download --no-deps``: pip's own
resolver cannot be used because it would fetch torch and its CUDA libraries. The first
version chosen for a name wins; a later requirement it does not satisfy is reported. On the
GPU box::

    python3 -m pip install --no-index --find-links .whl -r .whl/requirements.txt
    make gpu-check
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
EXCLUDE = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*)$")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)


def target_env(py: str) -> dict:
    """PEP 508 marker environment of the offline box (CPython ``py`` on x86_64 Linux)."""
    return {
        "python_version": py,
        "python_full_version": f"{py}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def wheel_requires(path: Path, extras: set, env: dict) -> list:
    """The ``Requires-Dist`` of a wheel that apply on the target (with ``extras``)."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(
            req.marker.evaluate(dict(env, extra=e)) for e in (extras or {""})
        ):
            out.append(req)
    return out


def main(argv=None) -> int:
    """Download the wheel closure; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", default=str(ROOT / ".whl"))
    p.add_argument("--python-version", default="3.12")
    p.add_argument("-r", "--requirement", default=str(ROOT / "requirements.txt"))
    args = p.parse_args(argv)
    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    env = target_env(args.python_version)
    top = [
        Requirement(ln.split("#", 1)[0].strip())
        for ln in Path(args.requirement).read_text().splitlines()
        if ln.split("#", 1)[0].strip()
    ]
    top = [r for r in top if not EXCLUDE.match(canonicalize_name(r.name))]
    (dest / "requirements.txt").write_text("".join(f"{r}\n" for r in top))
    have: dict = {}  # canonical name -> (version, wheel path)
    queue, problems = list(top), []
    pip = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for plat in PLATFORMS:
        pip += ["--platform", plat]
    while queue:
        level, queue = queue, []
        todo = {}
        for req in level:
            name = canonicalize_name(req.name)
            if EXCLUDE.match(name):
                continue
            if name in have:
                if req.specifier and not req.specifier.contains(have[name][0], prereleases=True):
                    problems.append(f"{req} (have {have[name][0]})")
                continue
            todo.setdefault(name, req)
        if not todo:
            break
        proc = subprocess.run(pip + [str(r) for r in todo.values()])
        if proc.returncode != 0:
            print(
                f"gpu_wheels: pip download failed for {[str(r) for r in todo.values()]}",
                file=sys.stderr,
            )
            return 1
        for whl in dest.glob("*.whl"):  # pip may reuse a wheel already in dest
            name, version, _, _ = parse_wheel_filename(whl.name)
            if name in todo and name not in have:
                have[name] = (version, whl)
                queue += wheel_requires(whl, set(todo[name].extras), env)
        missing = [n for n in todo if n not in have]
        if missing:
            print(f"gpu_wheels: no wheel found for {missing}", file=sys.stderr)
            return 1
    print(
        f"gpu_wheels: {len(have)} wheels in {dest} for CPython {args.python_version} "
        "manylinux x86_64 (torch, triton and nvidia-* left to the GPU box)"
    )
    for msg in problems:
        print(
            f"gpu_wheels: WARNING: requirement not satisfied by the chosen wheel: {msg}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
